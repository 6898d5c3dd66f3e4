"""The training loop: read it top to bottom, like nanoGPT's train.py.

set up processes → load data description → build model and optimizers → for each step: maybe
validate, then accumulate gradients over micro-batches, step the optimizers, log. Timing excludes
the first `timing_warmup_steps` steps (compile, allocator warm-up) and validation.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from speedrun.config import RESUMABLE_CHANGES, Config, changed_keys, config_from_dict
from speedrun.data.loader import TokenLoader, val_batches
from speedrun.data.prepare import default_data_dir, load_meta, prepare, tokenizer_for_data
from speedrun.data.shards import find_shards
from speedrun.errors import ConfigError, DataError, SpeedrunError
from speedrun.model.attention import window_tokens
from speedrun.model.gpt import GPT
from speedrun.model.summary import model_summary
from speedrun.train import distributed
from speedrun.train.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from speedrun.train.optimizers import build_optimizers
from speedrun.train.rundir import RunDir, default_run_dir, environment_report, peak_memory_bytes
from speedrun.train.schedule import lr_multiplier, muon_momentum
from speedrun.train.signals import RunInterrupted, StopSignals

AUTO_PREPARED_SOURCES = ("wiki-vital",)  # bundled offline, so `speedrun train` can prepare it itself


def resolve_data_dir(cfg: Config) -> Path:
    return Path(cfg.data.dir) if cfg.data.dir else default_data_dir(cfg.data.source, cfg.data.tokenizer)


def ensure_data(cfg: Config, ctx: distributed.DistContext, log=print) -> tuple[Path, dict[str, Any]]:
    """Return the shard folder and its meta.json, preparing bundled sources when they are missing."""
    data_dir = resolve_data_dir(cfg)
    default_dir = not cfg.data.dir  # an explicit data.dir is never filled behind the user's back
    if default_dir and not (data_dir / "meta.json").exists() and cfg.data.source in AUTO_PREPARED_SOURCES:
        if ctx.is_main:
            log(f"data: {data_dir} missing, preparing {cfg.data.source} with tokenizer {cfg.data.tokenizer}")
            prepare(cfg.data.source, cfg.data.tokenizer, data_dir, log=log)
        if ctx.distributed:
            torch.distributed.barrier()
    meta = load_meta(data_dir)
    if meta["tokenizer"] != cfg.data.tokenizer:
        raise DataError(
            f"{data_dir} was tokenized with {meta['tokenizer']} but the recipe asks for "
            f"data.tokenizer={cfg.data.tokenizer}"
        )
    if meta["vocab_size"] != cfg.model.vocab_size:
        raise DataError(
            f"{data_dir} has vocab size {meta['vocab_size']} but model.vocab_size is {cfg.model.vocab_size}"
        )
    if cfg.model.document_mask and meta["eot_id"] != cfg.model.eot_id:
        raise DataError(
            f"{data_dir} marks documents with token {meta['eot_id']}, model.eot_id is {cfg.model.eot_id}"
        )
    return data_dir, meta


def autocast(cfg: Config, device: torch.device):
    if cfg.train.dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model, cfg: Config, val_files, token_bytes, ctx) -> tuple[float, float | None]:
    """Mean val loss over exactly `val_tokens` tokens split across ranks, and bits per byte."""
    t = cfg.train
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, tokens, bytes
    model.eval()
    batches = val_batches(
        val_files,
        t.val_tokens,
        t.micro_batch_tokens,
        t.seq_len,
        ctx.rank,
        ctx.world_size,
        vocab_size=cfg.model.vocab_size,
        device=ctx.device,
    )
    for x, y in batches:
        with autocast(cfg, ctx.device):
            losses = model(x, y, reduction="none")
        totals[0] += losses.double().sum()
        totals[1] += y.numel()
        if token_bytes is not None:
            totals[2] += token_bytes[y].sum()
    model.train()
    distributed.all_reduce_sum(totals, ctx)
    loss = (totals[0] / totals[1]).item()
    bpb = (
        (totals[0] / (math.log(2) * totals[2])).item() if token_bytes is not None and totals[2] > 0 else None
    )
    return loss, bpb


def restore(run_dir: Path, cfg: Config, model, optimizers, loader) -> tuple[int, dict[str, Any]]:
    """Load the newest checkpoint of `run_dir` into model/optimizers/loader; return (step, state)."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise DataError(f"no checkpoint in {run_dir} to resume from (enable train.checkpoint_every)")
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
    if state["step"] >= cfg.train.steps:
        raise DataError(f"run in {run_dir} already finished ({state['step']} of {cfg.train.steps} steps)")
    for opt, opt_state in zip(optimizers, state["optimizers"], strict=True):
        opt.load_state_dict(opt_state)
    loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"]["cpu"])
    if torch.cuda.is_available() and state["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return state["step"], state


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return (
        f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def train(cfg: Config, out_dir: Path | None = None, resume: bool = False) -> dict[str, Any]:
    """Train `cfg` and return the summary (also written to the run directory). Rank 0 writes files.

    With `resume`, `out_dir` is an existing run directory: training continues from its newest
    checkpoint and produces the metrics the uninterrupted run would have.
    """
    wall_start = time.perf_counter()
    t = cfg.train
    ctx = distributed.setup(t.device)
    run, signals = None, StopSignals()
    try:
        run = RunDir(out_dir or default_run_dir(cfg.recipe), enabled=ctx.is_main, resume=resume)
        run.write_config(cfg)
        run.log(environment_report(), console=False)
        data_dir, meta = ensure_data(cfg, ctx, log=run.log)
        train_files, val_files = find_shards(data_dir, "train"), find_shards(data_dir, "val")
        tokenizer = tokenizer_for_data(data_dir, meta)
        token_bytes = torch.from_numpy(np.asarray(tokenizer.token_byte_lengths(), dtype=np.int64)).to(
            ctx.device
        )
        run.log(
            f"data: {data_dir} ({meta['tokenizer']}, vocab {meta['vocab_size']}, "
            f"{meta['splits']['train']['tokens']:,} train / {meta['splits']['val']['tokens']:,} val tokens)"
        )

        torch.manual_seed(t.seed)  # identical initial weights on every rank (DDP also broadcasts them)
        model = GPT(cfg.model).to(ctx.device)
        run.log(model_summary(model, t.seq_len))
        optimizers = build_optimizers(model, cfg)
        use_compile = t.compile == "on" or (t.compile == "auto" and ctx.device.type == "cuda")
        fwd = torch.compile(model) if use_compile else model
        if ctx.distributed:
            with warnings.catch_warnings():  # torch >= 2.13 renames broadcast_buffers; 2.11 knows only it
                warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
                fwd = DDP(
                    fwd,
                    device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
                    broadcast_buffers=False,  # our only buffers are rotary tables, equal on every rank
                    gradient_as_bucket_view=True,
                )

        loader = TokenLoader(
            train_files,
            t.global_batch_tokens,
            t.micro_batch_tokens,
            t.seq_len,
            ctx.rank,
            ctx.world_size,
            align_to_bos=cfg.data.align_to_bos,
            bos_id=meta["eot_id"],
            vocab_size=cfg.model.vocab_size,
            device=ctx.device,
        )
        accum = loader.accumulation_steps
        run.log(
            f"batch: {t.global_batch_tokens:,} tokens/step = "
            f"{ctx.world_size} processes x {accum} micro-steps x "
            f"{t.micro_batch_tokens:,} tokens ({t.micro_batch_tokens // t.seq_len} x {t.seq_len}); "
            f"{t.steps} steps, device {ctx.device}, compile {use_compile}, dtype {t.dtype}"
        )

        start_step, timed_s, timed_tokens, data_wait_s = 0, 0.0, 0, 0.0
        if resume:
            start_step, state = restore(run.path, cfg, model, optimizers, loader)
            timed_s, timed_tokens, data_wait_s = state["timed_s"], state["timed_tokens"], state["data_wait_s"]
            run.truncate_metrics(start_step)
            run.log(f"resumed from checkpoint at step {start_step} in {run.path}")
        untimed_until = start_step + t.timing_warmup_steps  # compile/warm-up again after a resume

        def checkpoint(done_steps: int) -> Path | None:
            state = {
                "step": done_steps,
                "optimizers": [opt.state_dict() for opt in optimizers],
                "loader": loader.state_dict(),
                "timed_s": timed_s,
                "timed_tokens": timed_tokens,
                "data_wait_s": data_wait_s,
                "rng": {
                    "cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if ctx.device.type == "cuda" else None,
                },
            }
            path = (
                save_checkpoint(run.path, done_steps, model, state, cfg.to_dict(), t.checkpoint_keep)
                if ctx.is_main
                else None
            )
            if ctx.distributed:
                torch.distributed.barrier()
            return path

        signals.install()
        val_loss = val_bpb = None
        for step in range(start_step, t.steps + 1):
            last = step == t.steps
            # ---- validation (not timed) ----
            if last or (t.val_every > 0 and step % t.val_every == 0):
                val_loss, val_bpb = evaluate(fwd, cfg, val_files, token_bytes, ctx)
                run.metric(
                    {
                        "step": step,
                        "val_loss": val_loss,
                        "val_bpb": val_bpb,
                        "tokens": step * t.global_batch_tokens,
                        "time_s": timed_s,
                    }
                )
                bpb = f" | val bpb {val_bpb:.4f}" if val_bpb is not None else ""
                run.log(
                    f"step {step:>5}/{t.steps} | val loss {val_loss:.4f}{bpb} | train time {timed_s:.1f}s"
                )
                if not math.isfinite(val_loss):
                    raise SpeedrunError(f"validation loss is {val_loss} at step {step}: training diverged")
            if last:
                break

            # ---- one optimizer step ----
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            step_start = time.perf_counter()
            mult = lr_multiplier(step, t)
            model.set_attention_window(window_tokens(step, t.steps, cfg.model))  # window warmup
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["initial_lr"] * mult
                    if "momentum" in group and cfg.optim.name == "muon":
                        group["momentum"] = muon_momentum(step, cfg.optim)
            loss_sum = torch.zeros((), device=ctx.device)
            step_wait_s = 0.0
            for micro in range(accum):
                x, y = loader.next_batch()
                step_wait_s += loader.last_wait_s
                sync = (
                    contextlib.nullcontext() if micro == accum - 1 or not ctx.distributed else fwd.no_sync()
                )
                with sync:
                    with autocast(cfg, ctx.device):
                        loss = fwd(x, y)
                    (loss / accum).backward()
                loss_sum += loss.detach()
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            for opt in optimizers:
                opt.step()
            model.zero_grad(set_to_none=True)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            step_s = time.perf_counter() - step_start
            data_wait_s += step_wait_s
            if step >= untimed_until:
                timed_s += step_s
                timed_tokens += t.global_batch_tokens

            # ---- logging, checkpoints, signals ----
            done = step + 1
            save = (t.checkpoint_every > 0 and done % t.checkpoint_every == 0) or (
                done == t.steps and t.checkpoint_at_end
            )
            stop_signal = signals.agreed(ctx)
            if step % t.log_every == 0 or done == t.steps or save or stop_signal:
                train_loss = distributed.all_reduce_sum(loss_sum / accum, ctx).item() / ctx.world_size
                if not math.isfinite(train_loss):  # before any checkpoint: never save poisoned weights
                    raise SpeedrunError(
                        f"training loss is {train_loss} at step {done}: training diverged; "
                        "the last good checkpoint (if any) is kept"
                    )
                avg = timed_s / max(1, done - untimed_until) if timed_tokens else step_s
                tok_s = timed_tokens / timed_s if timed_tokens else t.global_batch_tokens / step_s
                run.metric(
                    {
                        "step": done,
                        "train_loss": train_loss,
                        "tokens": done * t.global_batch_tokens,
                        "time_s": timed_s,
                        "lr": mult,
                        "step_ms": step_s * 1000,
                        "data_wait_ms": step_wait_s * 1000,
                    }
                )
                run.log(
                    f"step {step + 1:>5}/{t.steps} | loss {train_loss:.4f} | lr x{mult:.3f} | "
                    f"{step_s * 1000:6.0f} ms | {tok_s:,.0f} tok/s | "
                    f"eta {_fmt_duration(avg * (t.steps - done))}"
                )
            if save or stop_signal:
                path = checkpoint(done)
                run.log(f"checkpoint: {path}")
            if stop_signal:
                name = signal.Signals(stop_signal).name
                message = (
                    f"stopped by {name} after step {done}; resume with: speedrun train --resume {run.path}"
                )
                run.log(message, console=False)
                raise RunInterrupted(message, stop_signal)

        peak = peak_memory_bytes(ctx.device)
        summary = {
            "recipe": cfg.recipe,
            "steps": t.steps,
            "final_val_loss": val_loss,
            "final_val_bpb": val_bpb,
            "train_time_s": timed_s,
            "wall_time_s": time.perf_counter() - wall_start,
            "tokens_per_s": timed_tokens / timed_s if timed_s else None,
            "data_wait_s": data_wait_s,
            "peak_memory_bytes": peak,
            "run_dir": str(run.path),
        }
        bpb = f", val bpb {val_bpb:.4f}" if val_bpb is not None else ""
        run.log(
            f"done: val loss {val_loss:.4f}{bpb} | train time {timed_s:.1f}s "
            f"(wall {summary['wall_time_s']:.1f}s) | {summary['tokens_per_s'] or 0:,.0f} tok/s | "
            f"data wait {data_wait_s:.2f}s | peak memory {peak / 2**20:,.0f} MiB | run dir {run.path}"
        )
        return summary
    except (ConfigError, DataError, SpeedrunError) as e:
        if run is not None:
            run.log(f"error: {e}", console=False)
        raise
    finally:
        signals.restore()
        if run is not None:
            run.close()
        distributed.teardown(clean=sys.exc_info()[0] is None)
