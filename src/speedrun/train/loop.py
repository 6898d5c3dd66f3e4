"""The training loop: read `train()` top to bottom, like nanoGPT's train.py. Set-up, then per step:
schedule → validate (untimed) → `train_step` → at log points: read the loss, log, checkpoint, stop on a
signal. The host waits for the device only at log and validation points (reporting: `progress.py`)."""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from speedrun.config import Config
from speedrun.config.files import check_resume, config_from_dict
from speedrun.config.stages import stage_plan
from speedrun.data.loader import TokenLoader
from speedrun.errors import ConfigError, DataError, SpeedrunError, first_line
from speedrun.hardware import bf16_is_probed
from speedrun.model import families
from speedrun.model.gpt2026 import sampled
from speedrun.model.summary import model_summary
from speedrun.optim.build import RunOptimizer, build_optimizer, sharded_optimizer
from speedrun.perf import compiled_updates, graphs, overlap, swaps
from speedrun.train import distributed
from speedrun.train.evaluate import audited, evaluate
from speedrun.train.flops import first_and_last
from speedrun.train.plan.budget import Budget, settle_budget
from speedrun.train.plan.host_fit import fit_to_host
from speedrun.train.plan.memory import check_fits
from speedrun.train.plan.precision import decide as decide_precision
from speedrun.train.plan.run_data import load_data, open_loader
from speedrun.train.progress import Progress
from speedrun.train.run.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from speedrun.train.run.environment import environment_report
from speedrun.train.run.rundir import RunDir, default_run_dir, saved_decisions
from speedrun.train.run.tracking import Tracker
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.signals import RunInterrupted, StopSignals
from speedrun.train.stages import describe_stages
from speedrun.train.step import (
    autocast_dtype,
    autocast_label,
    share_micro_slots,
    size_micro_slots,
    train_step,
)
from speedrun.train.timing import StepClock
from speedrun.train.warmup import is_compiled, warm_up


def compiles(cfg: Config, device: torch.device) -> bool:
    """Whether the run's forwards are compiled: `train.compile=on`, or `auto` on CUDA."""
    return cfg.train.compile == "on" or (cfg.train.compile == "auto" and device.type == "cuda")


def build_model(cfg: Config, ctx: distributed.DistContext) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The GPT, created on its device, and the module its forwards run through: compiled (CUDA, or
    `train.compile=on`) inside DDP under torchrun, so DDPOptimizer splits the graph at bucket boundaries
    and the all-reduce overlaps the backward (tests/unit/test_ddp_compile.py)."""
    swaps.install(cfg.train.perf, ctx.device)  # the speed layer's kernels: chosen once, outside any graph
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank (DDP also broadcasts)
    with ctx.device:
        model = families.build_model(cfg.model)
    # compiled as the records are: a graph break fails
    train_model = torch.compile(model, dynamic=False, fullgraph=True) if compiles(cfg, ctx.device) else model
    if ctx.distributed and not sharded_optimizer(cfg):  # the 2025–26 optimizer communicates itself
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
        raise SpeedrunError(f"torch.compile failed ({first_line(e)}); run with train.compile=off") from None


def restore(
    run: RunDir,
    cfg: Config,
    model: torch.nn.Module,
    optimizer: RunOptimizer,
    loader: TokenLoader,
    clock: StepClock,
) -> tuple[int, int | None]:
    """Load the run's newest checkpoint into model, optimizer, loader and clock and drop later metrics; return
    its step (0 without one: the run starts over) and its budget's planned step count (None: none yet)."""
    checkpoints = list_checkpoints(run.path)
    if not checkpoints:
        run.start_over(cfg.train.steps)
        return 0, None
    state, saved = load_checkpoint(checkpoints[-1], model)
    try:  # through the typed config, so fields added since the checkpoint compare as their defaults
        saved_cfg = config_from_dict(saved, str(checkpoints[-1] / "config.json"))
    except ConfigError as e:
        raise DataError(f"checkpoint {checkpoints[-1]} has an unusable config: {e}") from None
    check_resume(
        saved_cfg,
        cfg,
        lambda key, before, after: DataError(
            f"checkpoint {checkpoints[-1]} was made with {key}={before!r}, this run has {after!r}"
        ),
    )
    if state["step"] >= cfg.train.steps and run.has_final_validation(cfg.train.steps):
        raise DataError(f"run in {run.path} already finished ({state['step']} of {cfg.train.steps} steps)")
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (KeyError, ValueError) as e:
        raise DataError(f"checkpoint {checkpoints[-1]} has no usable optimizer state ({e})") from None
    loader.load_state_dict(state["loader"])
    clock.load_state_dict(state["clock"])
    torch.set_rng_state(state["rng"]["cpu"])
    if torch.cuda.is_available() and state["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    run.truncate_metrics(state["step"])
    run.log(f"resumed from checkpoint at step {state['step']} in {run.path}")
    return state["step"], state.get("budget_steps")


def training_state(
    done: int,
    optimizer: RunOptimizer,
    loader: TokenLoader,
    clock: StepClock,
    device: torch.device,
    budget: Budget | None,
) -> dict[str, Any]:
    """Everything besides the weights that a resumed run needs to continue exactly."""
    return {
        "step": done,
        "budget_steps": budget.steps if budget is not None and budget.planned else None,
        "optimizer": optimizer.state_dict(),
        "loader": loader.state_dict(),
        "clock": clock.state_dict(),
        "rng": {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None,
        },
    }


def rank0_int(value: int, ctx: distributed.DistContext) -> int:
    """Rank 0's `value` on every rank (one collective), for choices measured on each process."""
    mine = torch.tensor([float(value if ctx.is_main else 0)], device=ctx.device)
    return int(distributed.all_reduce_sum(mine, ctx).item())


def follow_budget(
    budget: Budget,
    cfg: Config,
    rcfg: Config,
    done: int,
    interval: tuple[float, int],
    clock: StepClock,
    ctx: distributed.DistContext,
    run: RunDir,
) -> Budget:
    """Plan a time-budgeted run's step count again after a log point (rank 0's plan, train/plan/budget.py), in
    `rcfg`; once final (the warm-down began) it is saved in config.json with the budget spent."""
    line = budget.observe(done, *interval, clock.timed_s, clock.timed_steps)
    steps = rank0_int(budget.steps, ctx) if ctx.distributed else budget.steps
    if line:
        run.log(line)
    budget.steps = rcfg.train.steps = steps
    if not budget.final(done) or (cfg.train.time_budget_s == 0 and cfg.train.steps == steps):
        return budget
    if cfg.train.time_budget_s > 0:
        was = cfg.train.steps
        run.log(f"time budget: {steps} steps are final (train.steps was {was}; saved in config.json)")
    for c in (cfg, rcfg):
        c.train.steps, c.train.time_budget_s = steps, 0.0
    run.write_config(cfg)
    return budget


def train(cfg: Config, out_dir: Path | None = None, resume: bool = False) -> dict[str, Any]:
    """Train `cfg` and return the summary (rank 0 writes files). With `resume`, `out_dir` is a run that
    continues from its newest checkpoint with the metrics the uninterrupted run would have."""
    wall_start, t = time.perf_counter(), cfg.train
    notes: list[str] = []  # for the log, once it exists
    settle_budget(cfg, notes.append)  # a budget that cannot act is refused here, before anything runs
    ctx = distributed.setup(t.device, t.dist_timeout_s)
    run = loader = tracker = None
    signals = StopSignals(announce=ctx.is_main)
    try:
        # ---- set-up ----
        run = RunDir(out_dir or default_run_dir(cfg.recipe), enabled=ctx.is_main, resume=resume)
        # decided once per run (config.json's `decided`); rcfg: what the model, step and validation use
        saved = saved_decisions(run.path) if resume else None
        precision, rcfg, run.decided = decide_precision(cfg, ctx.device, saved)
        if ctx.distributed and saved is None and bf16_is_probed(ctx.device.type):  # a probe may differ
            keys = sorted(run.decided)  # rank 0's choices on every process, in one collective
            bits = rank0_int(sum(1 << i for i, k in enumerate(keys) if run.decided[k] == "bf16"), ctx)
            agreed = {k: "bf16" if bits >> i & 1 else "fp32" for i, k in enumerate(keys)}
            if agreed != run.decided:
                precision, rcfg, run.decided = decide_precision(cfg, ctx.device, agreed)
        run.write_config(cfg)
        run.log(environment_report(), console=False)
        for note in notes:
            run.log(note)
        data = load_data(cfg, ctx, run)  # data problems surface first, before any probe
        fit = t.budget_min_steps > 0 or t.compile == "auto"  # spent (0, on/off) in a resumed run's config
        if fit and t.time_budget_s > 0 and ctx.device.type == "cpu":
            agree = functools.partial(rank0_int, ctx=ctx)
            if fit_to_host(cfg, rcfg, ctx.device, ctx.is_main, agree, run.log):
                data = load_data(cfg, ctx, run)  # the batch changed: its split over processes too
            run.write_config(cfg)
        if ctx.device.type == "cuda":  # the memory guard: one line naming what fits, before any allocation
            need = check_fits(rcfg, ctx.world_size, compiles(rcfg, ctx.device), ctx.device)
            run.log(f"memory: estimated peak {need / 2**30:,.1f} GiB per process (train/plan/memory.py)")
        model, train_model = build_model(rcfg, ctx)
        compiled = is_compiled(train_model)  # not `is not model`: DDP wraps it too
        run.log(model_summary(model, rcfg, first_and_last(model, rcfg)))
        run.log(precision.describe())
        run.log(swaps.describe(rcfg.train.perf), console=False)
        optimizer = build_optimizer(model, rcfg)
        if compiled:
            optimizer.feed(train_model)
        if optimizer.describe():
            run.log(optimizer.describe())
        run.log(compiled_updates.install(optimizer, rcfg.train.perf, ctx.device))  # the speed layer's swaps
        run.log(overlap.install(optimizer, rcfg.train.perf, ctx.device, ctx.world_size))
        graph_line = graphs.install(optimizer, model, train_model, rcfg, ctx.device, ctx.world_size, compiled)
        run.log(graph_line, console=False)
        loader = open_loader(cfg, data, ctx)
        accum, dtype, clip = loader.accumulation_steps, autocast_dtype(rcfg), cfg.optim.grad_clip
        run.log(
            f"batch: {t.global_batch_tokens:,} tokens/step = {ctx.world_size} processes x {accum} "
            f"micro-steps x {data.micro_batch_tokens:,} tokens ({data.micro_batch_tokens // t.seq_len} x "
            f"{t.seq_len}); {t.steps} steps{' at most' if t.time_budget_s > 0 else ''}, "
            f"device {ctx.device}, "
            f"compile {compiled}, {autocast_label(rcfg)}"
        )
        if t.stages:  # the batch above is only the rows of a step: the stages set its tokens
            run.log(describe_stages(stage_plan(cfg), accum, ctx.world_size))
        clock = StepClock(ctx.device)
        size_micro_slots(model, ctx.world_size * accum)  # #89's delayed scales: one per micro-batch slot
        start_step, planned = restore(run, cfg, model, optimizer, loader, clock) if resume else (0, None)
        budget = Budget(cfg, planned) if t.time_budget_s > 0 else None  # rcfg.train.steps: its plan
        rcfg.train.steps = budget.steps if budget else t.steps
        if is_compiled(train_model):  # issue 20: compile every shape untimed, then restore everything
            one_val_batch = ctx.world_size * data.val_micro_batch_tokens
            compile_start = time.perf_counter()  # compile seconds: what a cold or warm cache changes
            with compile_errors(True):
                n = warm_up(rcfg, model, train_model, optimizer, loader, accum, dtype, lambda: evaluate(
                    train_model, rcfg, data.val_files, data.val_micro_batch_tokens, None, ctx, one_val_batch
                ), start_step)  # fmt: skip
            took = time.perf_counter() - compile_start
            run.log(
                f"warm-up: {n} training step(s) and one validation batch compiled in {took:.1f} s, "
                "state restored"
            )
        tracker = Tracker(  # resumed: TensorBoard hides the earlier events of the steps written again
            run.path, t.wandb_project, cfg.to_dict(), ctx.is_main, log=run.log,
            purge_step=start_step if resume else None,
        )  # fmt: skip
        progress = Progress(
            rcfg, ctx, run, tracker, clock, loader, model, start_step, wall_start, precision, data.source
        )

        def checkpoint(done: int) -> Path | None:
            state = training_state(done, optimizer, loader, clock, ctx.device, budget)
            share_micro_slots(model, ctx.rank, ctx.world_size)  # every slot saved, for any process count
            path = None
            if ctx.is_main:
                path = save_checkpoint(
                    run.path, done, model, state, cfg.to_dict(), t.checkpoint_keep, data.tokenizer.hash
                )
                run.log(f"checkpoint: {path}")
            if ctx.distributed:
                torch.distributed.barrier()
            return path

        # ---- the steps ----
        signals.install()
        after_step = families.family_of(model.cfg).after_step  # looked up once, not per step
        for step in range(start_step, t.steps + 1):  # t.steps: the most; rcfg.train.steps: the end
            sched = schedule_at(step, rcfg)
            lr = apply_schedule(sched, optimizer, model)  # (least, most) multiplier applied
            if step == rcfg.train.steps and optimizer.ships is not None:  # #92's terminal ships, on the clock
                clock.start()
                optimizer.ships.ship()
                clock.timed_s += clock.stop(1)  # timed seconds, no step (optim/ships.py)
            if step == rcfg.train.steps or (t.val_every > 0 and step % t.val_every == 0):
                clock.stop()  # validation is not training time
                # track 3's Tail-EMA blend where the recipe has one; weights or gradients written inside
                # the validation are counted (verify refuses them, #205)
                with optimizer.readout(), audited(model, clock):
                    val = evaluate(
                        train_model, rcfg, data.val_files, data.val_micro_batch_tokens, data.token_bytes, ctx
                    )
                progress.validation(step, *val)
            if step == rcfg.train.steps:
                break

            clock.start()
            after_step(model, step - 1)  # the family's refresh (#84/#89: FP8 copies this step trains with)
            with compile_errors(compiled):
                loss = train_step(
                    train_model, optimizer, loader.next_batch, accum, dtype, clip, sched.grad_scale,
                    (ctx.rank, ctx.world_size),  # slot_of: micro-step k is the step's chunk k x world + rank
                )  # fmt: skip
            progress.add(loss)

            done = step + 1
            save = (t.checkpoint_every > 0 and done % t.checkpoint_every == 0) or (
                done == rcfg.train.steps and t.checkpoint_at_end
            )
            local_stop = signals.received if not ctx.distributed else None  # free to check on one process
            if not progress.is_log_point(done, forced=bool(save or local_stop)):
                continue
            # ---- log point: the host waits for the device here, and only here ----
            timed_before = clock.timed_s, clock.timed_steps
            stop = progress.log_point(done, loss, lr, signals.received)
            if budget is not None:
                interval = (clock.timed_s - timed_before[0], clock.timed_steps - timed_before[1])
                budget = follow_budget(budget, cfg, rcfg, done, interval, clock, ctx, run)
            progress.samples(done, model, data.tokenizer)
            path = checkpoint(done) if save or stop else None
            if stop:
                run.write_summary(progress.summary("stopped", done))
                stopped = RunInterrupted.after(stop, done, path, run.path)
                run.log(str(stopped), console=False)
                raise stopped

        return progress.finish()
    except RuntimeError as e:  # a peer died mid-collective: one line, not a gloo or NCCL traceback
        if sampled.TOO_MANY_TARGETS in str(e):  # the data's, found on the device: no config check can know
            too_few = SpeedrunError(
                f"{sampled.TOO_MANY_TARGETS} (train.stages' sampled= count): a micro-batch's distinct "
                "targets must fit among the candidates; raise sampled= in the stages that sample (at most "
                "the vocabulary), or give fewer tokens per micro-batch"
            )
            if run is not None:
                run.log(f"error: {too_few}", console=False)
            raise too_few from None
        if not (ctx.distributed and run is not None and distributed.lost_peer(e)):
            raise
        checkpoints = list_checkpoints(run.path)
        lost = distributed.PeerLost.of(e, run.path, checkpoints[-1] if checkpoints else None)
        run.log(f"error: {lost}", console=False)
        raise lost from None
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
        # what holds the process group (DDP's reducer, the optimizer's pending collectives) goes before the
        # group: left to the frame's end, it was freed after destroy_process_group, and under load a rank
        # aborted in gloo's teardown after `done:` (a finished 4-process run exited non-zero; issue 46)
        model = train_model = optimizer = progress = None  # noqa: F841 (the checkpoint closure's cells too)
        gc.collect()
        distributed.teardown(clean=sys.exc_info()[0] is None)
