"""What a run reports, kept out of the loop. Between log points the losses are summed on the device;
at a log point one wait and one collective read the losses and the stop signal, then the log line,
metrics row and tracker point are written. Validation rows and the summary are built here too."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from speedrun.config import Config
from speedrun.config.stages import stage_plan
from speedrun.data.loader import TokenLoader
from speedrun.errors import SpeedrunError
from speedrun.model.generate import DEFAULT_SAMPLE_PROMPTS, sample_during_training
from speedrun.train import distributed
from speedrun.train.flops import run_flops, step_flops_at
from speedrun.train.plan.precision import Precision
from speedrun.train.run.environment import peak_memory_bytes
from speedrun.train.run.rundir import RunDir
from speedrun.train.run.tracking import Tracker, format_mfu, hardware_name, matmul_peak, mfu
from speedrun.train.schedule import tokens_through
from speedrun.train.signals import STOP_SIGNALS
from speedrun.train.timing import StepClock, format_duration


def log_point_values(
    last_loss: torch.Tensor, interval_loss: torch.Tensor, stop: int | None, ctx: distributed.DistContext
) -> tuple[float, float, int | None]:
    """Mean over ranks of the last step's loss and of the losses since the previous log point, and a
    stop signal any rank received: one collective and one read, the only ones between log points."""
    flags = [float(stop == sig) for sig in STOP_SIGNALS]  # every stop signal, SIGHUP included
    values = torch.cat(
        [last_loss.float().view(1), interval_loss.float().view(1), last_loss.new_tensor(flags)]
    )
    last, interval, *received = distributed.all_reduce_sum(values, ctx).tolist()
    # the last signal in STOP_SIGNALS any rank received (SIGTERM before SIGINT, as before)
    stop = next((sig for sig, n in zip(STOP_SIGNALS[::-1], received[::-1], strict=True) if n), None)
    return last / ctx.world_size, interval / ctx.world_size, stop


class Progress:
    """Log points, validation rows and the summary of one run (from `start_step` on, after a resume)."""

    def __init__(
        self,
        cfg: Config,
        ctx: distributed.DistContext,
        run: RunDir,
        tracker: Tracker,
        clock: StepClock,
        loader: TokenLoader,
        model: torch.nn.Module,
        start_step: int,
        wall_start: float,
        precision: Precision,
        data_source: str | None = None,
    ):
        self.cfg, self.ctx, self.run = cfg, ctx, run
        self.tracker, self.clock, self.loader = tracker, clock, loader
        self.wall_start = wall_start  # wall time includes the set-up
        self.data_source = data_source  # summary.json's: what `verify` checks the validation data by
        self.model = model  # the FLOPs count's (model/flops.py): at each step's windows
        self.precision = precision
        # MFU's denominator: the datasheet's on a known GPU, else a probe long enough to believe (a rate
        # above it prints no MFU rather than more than 100 %)
        self.peak_flops, self.peak_source = matmul_peak(ctx.device, precision.autocast)
        run.log(f"MFU: against {self.peak_flops / 1e12:,.3f} TFLOP/s per device, {self.peak_source}")
        self.first_step = start_step + 1  # its time includes compilation: no ETA from it
        self.untimed_until = start_step + cfg.train.timing_warmup_steps  # warm up again after a resume
        clock.starts.append(  # what this start adds to the run's history (summary.json: `verify`)
            {"step": start_step, "world_size": ctx.world_size, "device_name": hardware_name(ctx.device),
             "timing_warmup_steps": cfg.train.timing_warmup_steps, "precision": precision.dtype}
        )  # fmt: skip
        self.val_loss: float | None = None
        self.val_bpb: float | None = None
        self._loss_sum: torch.Tensor | None = None  # on the device: summed, never read between log points
        self._steps = 0
        self._wait_mark = loader.total_wait_s

    def add(self, loss: torch.Tensor) -> None:
        """Count one finished step and its loss (a device tensor; not read here)."""
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._steps += 1

    def is_log_point(self, done: int, forced: bool = False) -> bool:
        """Every `train.log_every` steps, and at the first step, the end of the timing warm-up and the
        last step (so compile time, the first timed rate and the end are always visible)."""
        t = self.cfg.train
        return forced or done % t.log_every == 0 or done in (self.first_step, self.untimed_until, t.steps)

    def log_point(
        self, done: int, last_loss: torch.Tensor, lr: tuple[float, float], stop: int | None
    ) -> int | None:
        """Wait for the device, read the losses (raise if training diverged), report the interval since
        the previous log point; return the stop signal any rank received. `lr`: the least and most LR
        multiplier the last step applied (apply_schedule's); metrics keep the most, `lr_min` the least."""
        t, clock, steps = self.cfg.train, self.clock, self._steps
        (lr_min, lr), lr_text = lr, f"{lr[1]:.3f}" if lr[0] == lr[1] else f"{lr[0]:.3g}..{lr[1]:.3f}"
        seconds = clock.stop(steps, timed=done - 1 >= self.untimed_until, through=done)
        train_loss, mean_loss, stop = log_point_values(last_loss, self._loss_sum, stop, self.ctx)
        if not math.isfinite(mean_loss):  # raised before any checkpoint: never save poisoned weights
            first = done - steps + 1
            where = f"at step {done}" if first == done else f"at a step from {first} to {done}"
            raise SpeedrunError(
                f"training loss is {mean_loss} {where}: training diverged; "
                "the last good checkpoint (if any) is kept"
            )
        step_s, wait_s = seconds / steps, (self.loader.total_wait_s - self._wait_mark) / steps
        mean_s = clock.mean_step_s(fallback=step_s)
        tok_s = (tokens_through(done, self.cfg) - tokens_through(done - 1, self.cfg)) / mean_s
        eta_s = mean_s * (t.steps - done)
        if t.time_budget_s > 0:  # until the plan is final, train.steps is only the cap: the budget bounds it
            eta_s = min(eta_s, max(0.0, t.time_budget_s - clock.timed_s))
        per_token = step_flops_at(self.model, self.cfg, done - 1)
        utilization = mfu(per_token, tok_s / self.ctx.world_size, self.peak_flops)
        self.run.metric(
            {"step": done, "train_loss": train_loss, "tokens": tokens_through(done, self.cfg),
             "time_s": clock.timed_s, "lr": lr, "step_ms": step_s * 1000, "data_wait_ms": wait_s * 1000,
             **({"lr_min": lr_min} if lr_min != lr else {})}
        )  # fmt: skip
        self.run.log(
            f"step {done:>5}/{t.steps} | loss {train_loss:.4f} | lr x{lr_text} | "
            f"{step_s * 1000:6.0f} ms | {tok_s:,.0f} tok/s | MFU {format_mfu(utilization)} | "
            f"eta {format_duration(eta_s, unknown=done == self.first_step)}"
        )
        self.tracker.log(
            done, {"train_loss": train_loss, "lr": lr, "tokens_per_s": tok_s, "mfu": utilization}
        )
        self._loss_sum, self._steps, self._wait_mark = None, 0, self.loader.total_wait_s
        return stop

    def validation(self, step: int, val_loss: float, val_bpb: float | None) -> None:
        """Report a validation; raise if the loss is not finite."""
        self.val_loss, self.val_bpb, t = val_loss, val_bpb, self.cfg.train
        self.run.metric(
            {"step": step, "val_loss": val_loss, "val_bpb": val_bpb,
             "tokens": tokens_through(step, self.cfg), "time_s": self.clock.timed_s}
        )  # fmt: skip
        bpb = f" | val bpb {val_bpb:.4f}" if val_bpb is not None else ""
        self.run.log(
            f"step {step:>5}/{t.steps} | val loss {val_loss:.4f}{bpb} | train time {self.clock.timed_s:.1f}s"
        )
        self.tracker.log(step, {"val_loss": val_loss, "val_bpb": val_bpb})
        if not math.isfinite(val_loss):
            raise SpeedrunError(f"validation loss is {val_loss} at step {step}: training diverged")

    def samples(self, done: int, model: torch.nn.Module, tokenizer: Any) -> None:
        """Every `train.sample_every` steps, log what the model writes after a few fixed prompts."""
        every = self.cfg.train.sample_every
        if every > 0 and done % every == 0 and self.ctx.is_main:
            texts = sample_during_training(model, tokenizer, DEFAULT_SAMPLE_PROMPTS)
            for prompt, text in zip(DEFAULT_SAMPLE_PROMPTS, texts, strict=True):
                self.run.log(f"sample at step {done}: {prompt!r} -> {text!r}")

    def summary(self, status: str, steps: int | None = None) -> dict[str, Any]:
        """summary.json: the run's result (`status` "finished" or "stopped") after `steps` optimizer steps
        (default `train.steps`; a stopped run's own count, which compare, verify and ablate read)."""
        t, clock = self.cfg.train, self.clock
        steps = t.steps if steps is None else steps
        timed = clock.timed_steps and steps
        return {
            "recipe": self.cfg.recipe,
            "steps": steps,
            "final_val_loss": self.val_loss,
            "final_val_bpb": self.val_bpb,
            "train_time_s": clock.timed_s,
            "wall_time_s": time.perf_counter() - self.wall_start,
            "tokens_per_s": tokens_through(steps, self.cfg) / steps / clock.mean_step_s() if timed else None,
            "data_wait_s": self.loader.total_wait_s,
            "peak_memory_bytes": peak_memory_bytes(self.ctx.device),
            "precision": {"dtype": self.precision.dtype, "reason": self.precision.reason},
            "mfu_peak_flops": self.peak_flops,
            "mfu_peak_source": self.peak_source,
            "run_dir": str(self.run.path),
            "status": status,
            "device_name": hardware_name(self.ctx.device),
            "world_size": self.ctx.world_size,
            "data_source": self.data_source,
            "flops_per_token": round(
                step_flops_at(self.model, self.cfg, max(0, steps - 1))
            ),  # the last step's
            "train_flops": run_flops(self.model, self.cfg, steps),  # Σ tokens × each step's count
            "timed_steps": clock.timed_steps,
            "starts": clock.starts,
            "timed_through": clock.timed_through,
            "extension_steps": plan.extension_steps if (plan := stage_plan(self.cfg)) else 0,
            "eval_writes": clock.eval_writes,
            "sampled_candidates": sorted({p for s in plan.stages for p in s.sampled}) if plan else [],
            "val_classes": self.model.lm_head.weight.size(0),  # the sampled loss refuses eval mode (#92)
        }

    def finish(self) -> dict[str, Any]:
        """Write summary.json and the closing log line; return the summary."""
        result = self.summary("finished")
        self.run.write_summary(result)
        bpb = f", val bpb {self.val_bpb:.4f}" if self.val_bpb is not None else ""
        if self.clock.timed_steps:
            timed = (
                f"train time {self.clock.timed_s:.1f}s (wall {result['wall_time_s']:.1f}s) | "
                f"{result['tokens_per_s']:,.0f} tok/s"
            )
        else:  # every step was timing warm-up (compilation, first calls): no rate to report
            warm = self.cfg.train.timing_warmup_steps
            wall = result["wall_time_s"]
            timed = f"no step timed (all within train.timing_warmup_steps={warm}; wall {wall:.1f}s)"
        self.run.log(
            f"done: val loss {self.val_loss:.4f}{bpb} | {timed} | "
            f"data wait {self.loader.total_wait_s:.2f}s | "
            f"peak memory {result['peak_memory_bytes'] / 2**20:,.0f} MiB | run dir {self.run.path}"
        )
        return result
