"""`speedrun bench`: time a recipe's training step on synthetic tokens, on whatever device is present.

Model, optimizer, compile, dtype and the middle step's schedule are built as `speedrun train` builds
them, and every step is the project's `train_step`; tokens are Zipf-distributed with geometric-length
documents (realistic mask boundaries). Reported: median step time split into forward+backward and
optimizer (synchronized around the optimizer), tokens/s, MFU against the measured matmul peak (and
the datasheet peak when known), and peak memory beside the memory guard's CUDA estimate."""

from __future__ import annotations

import functools
import itertools
import statistics
import sys
import time

import numpy as np
import torch

from speedrun.config import Config
from speedrun.data.bos_loader import cu_seqlens, record_max_docs
from speedrun.model.families import family_of
from speedrun.model.flops import FORMULA, step_flops
from speedrun.train.distributed import DistContext, cuda_allocator_settings
from speedrun.train.environment import peak_memory_bytes
from speedrun.train.loop import build_model
from speedrun.train.memory import estimate_memory, estimate_peak_bytes
from speedrun.train.optimizers import RunOptimizer, build_optimizer
from speedrun.train.precision import effective_config
from speedrun.train.precision import resolve as resolve_precision
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.step import autocast_dtype, autocast_label, train_step
from speedrun.train.timing import wait_for_device
from speedrun.train.tracking import datasheet_peak, device_name, format_mfu, mfu, probe_matmul_peak
from speedrun.train.warmup import is_compiled


def synthetic_tokens(n: int, vocab_size: int, eot_id: int, mean_doc: int, seed: int = 0) -> np.ndarray:
    """`n` token ids: Zipf-distributed (p ∝ 1/(rank + 10)), documents of geometric length starting with
    `eot_id`, which appears nowhere else."""
    rng = np.random.default_rng(seed)
    p = 1.0 / (np.arange(vocab_size) + 10.0)
    tokens = rng.permutation(vocab_size)[rng.choice(vocab_size, size=n, p=p / p.sum())]
    tokens[tokens == eot_id] = (eot_id + 1) % vocab_size
    starts = np.cumsum(rng.geometric(1.0 / max(1, mean_doc), size=n // max(1, mean_doc) * 2 + 2))
    tokens[0] = eot_id
    tokens[starts[starts < n]] = eot_id
    return tokens


class _TimedOptimizer:
    """Passes through to the run's optimizer and records how long each `step()` takes on the device."""

    def __init__(self, inner: RunOptimizer, device: torch.device):
        self.inner, self.device, self.last_s = inner, device, 0.0

    def step(self) -> None:
        wait_for_device(self.device)
        start = time.perf_counter()
        self.inner.step()
        wait_for_device(self.device)
        self.last_s = time.perf_counter() - start

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def parameters(self):
        return self.inner.parameters()


def run_bench(cfg: Config, device: torch.device, steps: int = 10, warmup: int = 3) -> dict:
    """Time `warmup` + `steps` optimizer steps of `cfg`; returns the measurements (see module doc)."""
    precision = resolve_precision(cfg, device)
    cfg = effective_config(cfg, precision)  # the dtype this device runs fast, as `speedrun train` does
    t = cfg.train
    accum = t.global_batch_tokens // t.micro_batch_tokens
    if device.type == "cuda":
        cuda_allocator_settings()
    model, train_model = build_model(cfg, DistContext(rank=0, local_rank=0, world_size=1, device=device))
    compiled = is_compiled(train_model)  # the one rule (the loop also runs it under DDP)
    optimizer = build_optimizer(model, cfg)
    timed = _TimedOptimizer(optimizer, device)
    schedule = schedule_at(t.steps // 2, cfg)
    apply_schedule(schedule, optimizer, model)

    n_pool = min(accum, 4)  # a few distinct micro-batches, reused: the loader is not what is measured
    vocab = cfg.model.vocab_size
    eot = cfg.model.eot_id if cfg.model.eot_id < vocab else vocab - 1  # BPE vocabularies end with it
    pool = synthetic_tokens(n_pool * t.micro_batch_tokens + 1, vocab, eot, 1000)
    pool_t = torch.from_numpy(pool.astype(np.int64)).to(device)
    m, shape = t.micro_batch_tokens, (t.micro_batch_tokens // t.seq_len, t.seq_len)
    varlen = cfg.model.attention == "varlen"  # the loader's packed row with cu_seqlens: training's path
    if varlen:
        shape = (1, m)
    max_docs = cfg.data.max_docs or record_max_docs(m)
    pairs = []
    for a in range(0, n_pool * m, m):
        x, y = pool_t[a : a + m].view(shape), pool_t[a + 1 : a + m + 1].view(shape)
        cu = cu_seqlens(pool[a : a + m], eot, max_docs)[0] if varlen else None
        pairs.append((x, y, torch.from_numpy(cu).to(device)) if varlen else (x, y))
    next_batch = functools.partial(next, itertools.cycle(pairs))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s, opt_s, losses, warmup_s = [], [], [], []
    clip = cfg.optim.grad_clip
    began = time.perf_counter()
    for i in range(warmup + steps):
        wait_for_device(device)
        start = time.perf_counter()
        loss = train_step(
            train_model, timed, next_batch, accum, autocast_dtype(cfg), clip, schedule.grad_scale
        )
        wait_for_device(device)
        if i >= warmup:
            step_s.append(time.perf_counter() - start)
            opt_s.append(timed.last_s)
        else:  # the first holds the compile: said as it ends, so a slow compile is seen, not guessed
            warmup_s.append(time.perf_counter() - start)
            print(
                f"bench: warm-up step {i + 1} took {warmup_s[-1]:.1f} s "
                f"({time.perf_counter() - began:.1f} s since the first)",
                file=sys.stderr,
                flush=True,
            )
        losses.append(float(loss))
    step, opt = statistics.median(step_s), statistics.median(opt_s)
    # the FLOPs the timed steps did: the schedule's windows, the packed rows' documents where known
    windows = family_of(cfg.model).step_windows(cfg.model, schedule)
    doc_lens = [int(n) for pair in pairs[:n_pool] if len(pair) == 3 for n in pair[2].diff().tolist()] or None
    flops_per_token = step_flops(model, windows, doc_lens, seq_len=t.seq_len)
    tokens_per_s = t.global_batch_tokens / step
    name = device_name(device)
    measured = probe_matmul_peak(device, precision.autocast or torch.float32)  # >= 1 s: one to believe
    sheet = datasheet_peak(name) if device.type == "cuda" else None
    return {
        "recipe": cfg.recipe,
        "device": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "compile": compiled,
        "autocast": autocast_label(cfg),
        "precision": precision.describe(),
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_per_step": t.global_batch_tokens,
        "accumulation_steps": accum,
        "window": model.varlen_windows.long if varlen else schedule.window,
        "attention": cfg.model.attention,
        "steps_timed": steps,
        "warmup_steps": warmup,
        "warmup_step_s": warmup_s,
        "step_ms": step * 1000,
        "step_ms_min": min(step_s) * 1000,
        "forward_backward_ms": (step - opt) * 1000,
        "optimizer_ms": opt * 1000,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "measured_peak_flops": measured,
        "mfu_measured_peak": mfu(flops_per_token, tokens_per_s, measured),
        "datasheet_bf16_peak_flops": sheet,
        "mfu_datasheet_peak": mfu(flops_per_token, tokens_per_s, sheet) if sheet else None,
        "peak_memory_bytes": peak_memory_bytes(device),
        "memory_estimate_bytes": estimate_peak_bytes(cfg, 1, compiled),  # this run's compile setting
        # what the bench's own peak should be compared with: it trains, it never validates
        "memory_estimate_training_bytes": estimate_memory(cfg, 1, compiled).backward_start,
        "memory_estimate_other_bytes": estimate_peak_bytes(cfg, 1, not compiled),
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def format_bench(r: dict) -> str:
    """The human table of `run_bench`'s result."""
    peak = r["datasheet_bf16_peak_flops"]
    sheet = "no datasheet peak known for this device"
    if peak:
        sheet = (
            f"{format_mfu(r['mfu_datasheet_peak'])} of datasheet dense bf16 peak {peak / 1e12:,.1f} TFLOP/s"
        )
    lines = [
        f"bench {r['recipe']} on {r['device']} | torch {r['torch']}, {r['threads']} threads | "
        f"compile {r['compile']} | {r['autocast']}",
        f"{r['params']:,} params | {r['tokens_per_step']:,} tokens/step "
        f"({r['accumulation_steps']} micro-batch{'es' if r['accumulation_steps'] > 1 else ''}) | "
        f"{r['flops_per_token'] / 1e6:,.1f} MFLOP/token | "
        f"window {r['window'] or 'none'}",
        f"  step time      {r['step_ms']:9.1f} ms  "
        f"(median of {r['steps_timed']}, min {r['step_ms_min']:.1f})",
        f"  first step     {r['warmup_step_s'][0] * 1000 if r['warmup_step_s'] else float('nan'):9.1f} ms  "
        f"(untimed: compile, if any, and warm-up)",
        f"  fwd+bwd        {r['forward_backward_ms']:9.1f} ms",
        f"  optimizer      {r['optimizer_ms']:9.1f} ms",
        f"  tokens/s       {r['tokens_per_s']:9,.0f}",
        f"  MFU            {format_mfu(r['mfu_measured_peak']):>9}  of the probed matmul peak "
        f"{r['measured_peak_flops'] / 1e12:,.2f} TFLOP/s (a thread's median x threads); {sheet}",
        f"  peak memory    {r['peak_memory_bytes'] / 2**20:9,.0f} MiB  (CUDA estimate of a training step "
        f"{r['memory_estimate_training_bytes'] / 2**20:,.0f} MiB; of the run with validation "
        f"{r['memory_estimate_bytes'] / 2**20:,.0f} MiB {'compiled' if r['compile'] else 'eager'}, "
        f"{r['memory_estimate_other_bytes'] / 2**20:,.0f} MiB {'eager' if r['compile'] else 'compiled'})",
        f"  loss           {r['loss_first']:.3f} -> {r['loss_last']:.3f} (synthetic Zipf tokens)",
        f"  FLOPs counted  {FORMULA}",
    ]
    return "\n".join(lines)
