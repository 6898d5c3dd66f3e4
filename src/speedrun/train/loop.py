"""The training loop: read `train()` top to bottom, like nanoGPT's train.py.

Set-up (processes, run directory, data, model, optimizer, loader, resume), then for each step:
schedule → validate (not timed) → one `train_step` → at log points: read the loss, log, checkpoint,
stop on a signal. The host waits for the device only at log and validation points, so the GPU
never idles between steps; step times and tokens/s are exact averages over the steps between them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from speedrun.config import RESUMABLE_CHANGES, Config, changed_keys, config_from_dict
from speedrun.data.loader import TokenLoader
from speedrun.errors import ConfigError, DataError, SpeedrunError
from speedrun.model.gpt import GPT
from speedrun.model.summary import model_summary
from speedrun.tools.sample import DEFAULT_SAMPLE_PROMPTS, sample_during_training
from speedrun.train import distributed
from speedrun.train.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from speedrun.train.evaluate import evaluate
from speedrun.train.optimizers import RunOptimizer, build_optimizer
from speedrun.train.run_data import load_data
from speedrun.train.rundir import RunDir, default_run_dir, environment_report, peak_memory_bytes
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.signals import RunInterrupted, StopSignals
from speedrun.train.step import autocast_dtype, train_step
from speedrun.train.timing import StepClock, format_duration
from speedrun.train.tracking import Tracker, datasheet_peak, device_name, measured_matmul_peak, mfu


@functools.cache
def matmul_peak(device: torch.device) -> float:
    """FLOP/s that MFU is measured against: the datasheet bf16 peak of a known GPU, else a quick
    measurement of this device's bf16 matmul (about 0.1 s on a CPU; once per process)."""
    size = 8192 if device.type == "cuda" else 1536  # as stable as 2048 here, a third of the time
    return datasheet_peak(device_name(device)) or measured_matmul_peak(device, size=size, iters=5)


def build_model(cfg: Config, ctx: distributed.DistContext) -> tuple[GPT, torch.nn.Module]:
    """The GPT, created directly on its device (no CPU copy), and the module its forwards run through:
    compiled (CUDA, or `train.compile=on`) and wrapped in DDP under torchrun."""
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank (DDP also broadcasts)
    with ctx.device:
        model = GPT(cfg.model)
    c = cfg.train.compile
    train_model = torch.compile(model) if c == "on" or (c == "auto" and ctx.device.type == "cuda") else model
    if ctx.distributed:
        with warnings.catch_warnings():  # torch >= 2.13 renames broadcast_buffers; 2.11 knows only it
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            train_model = DDP(
                train_model,
                device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
                broadcast_buffers=False,  # our buffers (rotary tables, window) are equal on all ranks
                gradient_as_bucket_view=True,
            )
    return model, train_model


@contextlib.contextmanager
def compile_errors(compiled: bool) -> Iterator[None]:
    """torch.compile fails at the first forward when this machine cannot build its kernels (no C++
    compiler on a CPU, for instance): say so in one line, with the setting that avoids it."""
    try:
        yield
    except Exception as e:
        if not compiled or not isinstance(e, torch._dynamo.exc.TorchDynamoException):
            raise
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise SpeedrunError(f"torch.compile failed ({reason}); run with train.compile=off") from None


def restore(run: RunDir, cfg: Config, model: GPT, optimizer: RunOptimizer, loader) -> dict[str, Any]:
    """Load the newest checkpoint of the run into model, optimizer and loader; return its state."""
    checkpoints = list_checkpoints(run.path)
    if not checkpoints:
        raise DataError(f"no checkpoint in {run.path} to resume from (enable train.checkpoint_every)")
    state, saved = load_checkpoint(checkpoints[-1], model)
    try:  # through the typed config, so fields added since the checkpoint compare as their defaults
        saved_cfg = config_from_dict(saved, str(checkpoints[-1] / "config.json"))
    except ConfigError as e:
        raise DataError(f"checkpoint {checkpoints[-1]} has an unusable config: {e}") from None
    for key, before, after in changed_keys(saved_cfg, cfg):
        if key not in RESUMABLE_CHANGES:
            raise DataError(
                f"checkpoint {checkpoints[-1]} was made with {key}={before!r}, this run has {after!r}"
            )
    if state["step"] >= cfg.train.steps and run.has_final_validation(cfg.train.steps):
        raise DataError(f"run in {run.path} already finished ({state['step']} of {cfg.train.steps} steps)")
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (KeyError, ValueError) as e:
        raise DataError(f"checkpoint {checkpoints[-1]} has no usable optimizer state ({e})") from None
    loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"]["cpu"])
    if torch.cuda.is_available() and state["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return state


def training_state(
    done: int, optimizer: RunOptimizer, loader: TokenLoader, clock: StepClock, device: torch.device
) -> dict[str, Any]:
    """Everything besides the weights that a resumed run needs to continue exactly."""
    return {
        "step": done,
        "optimizer": optimizer.state_dict(),
        "loader": loader.state_dict(),
        "clock": clock.state_dict(),
        "rng": {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None,
        },
    }


def log_point_values(
    last_loss: torch.Tensor, interval_loss: torch.Tensor, stop: int | None, ctx: distributed.DistContext
) -> tuple[float, float, int | None]:
    """Mean over ranks of the last step's loss and of the losses since the previous log point, and a
    stop signal any rank received: one collective and one read, the only ones between log points."""
    flags = [float(stop == signal.SIGINT), float(stop == signal.SIGTERM)]
    values = torch.cat(
        [last_loss.float().view(1), interval_loss.float().view(1), last_loss.new_tensor(flags)]
    )
    last, interval, sigint, sigterm = distributed.all_reduce_sum(values, ctx).tolist()
    stop = signal.SIGTERM if sigterm else signal.SIGINT if sigint else None
    return last / ctx.world_size, interval / ctx.world_size, stop


def train(cfg: Config, out_dir: Path | None = None, resume: bool = False) -> dict[str, Any]:
    """Train `cfg` and return the summary (also written to the run directory). Rank 0 writes files.

    With `resume`, `out_dir` is an existing run directory: training continues from its newest
    checkpoint and produces the metrics the uninterrupted run would have.
    """
    wall_start = time.perf_counter()
    t = cfg.train
    ctx = distributed.setup(t.device)
    run = loader = tracker = None
    signals = StopSignals(announce=ctx.is_main)
    try:
        # ---- set-up ----
        run = RunDir(out_dir or default_run_dir(cfg.recipe), enabled=ctx.is_main, resume=resume)
        run.write_config(cfg)
        run.log(environment_report(), console=False)
        tracker = Tracker(run.path, t.wandb_project, cfg.to_dict(), enabled=ctx.is_main)
        data = load_data(cfg, ctx, run)
        micro, val_files, token_bytes = data.micro_batch_tokens, data.val_files, data.token_bytes
        model, train_model = build_model(cfg, ctx)
        run.log(model_summary(model, t.seq_len))
        flops_per_token, peak_flops = model.flops_per_token(t.seq_len), matmul_peak(ctx.device)
        optimizer = build_optimizer(model, cfg)
        loader = TokenLoader(
            data.train_files, t.global_batch_tokens, micro, t.seq_len, ctx.rank, ctx.world_size,
            align_to_bos=cfg.data.align_to_bos, bos_id=data.eot_id, vocab_size=cfg.model.vocab_size,
            device=ctx.device,
        )  # fmt: skip
        accum, dtype, clip = loader.accumulation_steps, autocast_dtype(cfg), cfg.optim.grad_clip
        run.log(
            f"batch: {t.global_batch_tokens:,} tokens/step = {ctx.world_size} processes x {accum} "
            f"micro-steps x {micro:,} tokens ({micro // t.seq_len} x {t.seq_len}); {t.steps} steps, "
            f"device {ctx.device}, compile {train_model is not model}, dtype {t.dtype}"
        )
        start_step, clock = 0, StepClock(ctx.device)
        if resume:
            state = restore(run, cfg, model, optimizer, loader)
            start_step = state["step"]
            clock.load_state_dict(state["clock"])
            run.truncate_metrics(start_step)
            run.log(f"resumed from checkpoint at step {start_step} in {run.path}")
        untimed_until = start_step + t.timing_warmup_steps  # compile/warm-up again after a resume
        first_step = start_step + 1  # its time includes compilation: no ETA from it

        def checkpoint(done: int) -> Path | None:
            state = training_state(done, optimizer, loader, clock, ctx.device)
            path = None
            if ctx.is_main:
                path = save_checkpoint(run.path, done, model, state, cfg.to_dict(), t.checkpoint_keep)
                run.log(f"checkpoint: {path}")
            if ctx.distributed:
                torch.distributed.barrier()
            return path

        def summary(status: str) -> dict[str, Any]:
            return {
                "recipe": cfg.recipe,
                "steps": t.steps,
                "final_val_loss": val_loss,
                "final_val_bpb": val_bpb,
                "train_time_s": clock.timed_s,
                "wall_time_s": time.perf_counter() - wall_start,
                "tokens_per_s": t.global_batch_tokens / clock.mean_step_s() if clock.timed_steps else None,
                "data_wait_s": loader.total_wait_s,
                "peak_memory_bytes": peak_memory_bytes(ctx.device),
                "run_dir": str(run.path),
                "status": status,
            }

        # ---- the steps ----
        signals.install()
        val_loss = val_bpb = None
        interval_loss, interval_steps, wait_mark = None, 0, 0.0
        for step in range(start_step, t.steps + 1):
            sched = schedule_at(step, cfg)
            apply_schedule(sched, optimizer, model)
            if step == t.steps or (t.val_every > 0 and step % t.val_every == 0):
                clock.stop()
                val_loss, val_bpb = evaluate(train_model, cfg, val_files, micro, token_bytes, ctx)
                run.metric(
                    {"step": step, "val_loss": val_loss, "val_bpb": val_bpb,
                     "tokens": step * t.global_batch_tokens, "time_s": clock.timed_s}
                )  # fmt: skip
                bpb = f" | val bpb {val_bpb:.4f}" if val_bpb is not None else ""
                run.log(
                    f"step {step:>5}/{t.steps} | val loss {val_loss:.4f}{bpb} | "
                    f"train time {clock.timed_s:.1f}s"
                )
                tracker.log(step, {"val_loss": val_loss, "val_bpb": val_bpb})
                if not math.isfinite(val_loss):
                    raise SpeedrunError(f"validation loss is {val_loss} at step {step}: training diverged")
            if step == t.steps:
                break

            clock.start()
            with compile_errors(compiled=train_model is not model):
                loss = train_step(train_model, optimizer, loader.next_batch, accum, dtype, clip)
            interval_loss = loss if interval_loss is None else interval_loss + loss
            interval_steps += 1

            done = step + 1
            save = (t.checkpoint_every > 0 and done % t.checkpoint_every == 0) or (
                done == t.steps and t.checkpoint_at_end
            )
            local_stop = signals.received if not ctx.distributed else None  # free to check on one process
            if (
                done % t.log_every
                and done not in (first_step, untimed_until, t.steps)
                and not (save or local_stop)
            ):
                continue
            # ---- log point: the host waits for the device here, and only here ----
            seconds = clock.stop(interval_steps, timed=step >= untimed_until)
            train_loss, mean_loss, stop = log_point_values(loss, interval_loss, signals.received, ctx)
            if not math.isfinite(mean_loss):  # before any checkpoint: never save poisoned weights
                first = done - interval_steps + 1
                where = f"at step {done}" if first == done else f"at a step from {first} to {done}"
                raise SpeedrunError(
                    f"training loss is {mean_loss} {where}: training diverged; "
                    "the last good checkpoint (if any) is kept"
                )
            step_s, wait_s = seconds / interval_steps, (loader.total_wait_s - wait_mark) / interval_steps
            tok_s = t.global_batch_tokens / clock.mean_step_s(fallback=step_s)
            eta_s = clock.mean_step_s(fallback=step_s) * (t.steps - done)
            utilization = mfu(flops_per_token, tok_s / ctx.world_size, peak_flops)
            run.metric(
                {"step": done, "train_loss": train_loss, "tokens": done * t.global_batch_tokens,
                 "time_s": clock.timed_s, "lr": sched.lr, "step_ms": step_s * 1000,
                 "data_wait_ms": wait_s * 1000}
            )  # fmt: skip
            run.log(
                f"step {done:>5}/{t.steps} | loss {train_loss:.4f} | lr x{sched.lr:.3f} | "
                f"{step_s * 1000:6.0f} ms | {tok_s:,.0f} tok/s | MFU {utilization:.1%} | "
                f"eta {format_duration(eta_s, unknown=done == first_step)}"
            )
            tracker.log(
                done, {"train_loss": train_loss, "lr": sched.lr, "tokens_per_s": tok_s, "mfu": utilization}
            )
            if t.sample_every > 0 and done % t.sample_every == 0 and ctx.is_main:
                prompts = DEFAULT_SAMPLE_PROMPTS
                samples = sample_during_training(model, data.tokenizer, prompts)
                for prompt, text in zip(prompts, samples, strict=True):
                    run.log(f"sample at step {done}: {prompt!r} -> {text!r}")
            interval_loss, interval_steps, wait_mark = None, 0, loader.total_wait_s
            path = checkpoint(done) if save or stop else None
            if stop:
                run.write_summary(summary("stopped"))
                stopped = RunInterrupted.after(stop, done, path, run.path)
                run.log(str(stopped), console=False)
                raise stopped

        # ---- summary ----
        result = summary("finished")
        run.write_summary(result)
        bpb = f", val bpb {val_bpb:.4f}" if val_bpb is not None else ""
        run.log(
            f"done: val loss {val_loss:.4f}{bpb} | train time {clock.timed_s:.1f}s "
            f"(wall {result['wall_time_s']:.1f}s) | {result['tokens_per_s'] or 0:,.0f} tok/s | "
            f"data wait {loader.total_wait_s:.2f}s | "
            f"peak memory {result['peak_memory_bytes'] / 2**20:,.0f} MiB | run dir {run.path}"
        )
        return result
    except (ConfigError, DataError, SpeedrunError) as e:
        if run is not None:
            run.log(f"error: {e}", console=False)
        raise
    finally:
        signals.restore()
        if tracker is not None:
            tracker.close()
        if loader is not None:
            loader.close()
        if run is not None:
            run.close()
        distributed.teardown(clean=sys.exc_info()[0] is None)
