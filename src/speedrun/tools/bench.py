"""`speedrun bench`: time a recipe's training step, stage by stage, on synthetic shards, on whatever
device is present.

Model, optimizer, compile, dtype, the loader (its packing and `cu_seqlens`) and each stage's schedule
(batch, windows, YaRN, MTP weights, FP8 refresh) are built as `speedrun train` builds them, and every step
is the project's `train_step`; tokens are Zipf-distributed with geometric-length documents, written as a
real shard. Per stage: median step time split into forward+backward and optimizer (synchronized around
the optimizer), tokens/s, the graphs compiled and the seconds they took, MFU, peak memory, and the
record's own figure with our/record ratio where anchors.toml has one."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from speedrun.config import Config
from speedrun.config.stages import stage_plan
from speedrun.data.bos_loader import DocumentLoader
from speedrun.data.loader import TokenLoader
from speedrun.data.shards import write_shard
from speedrun.errors import ConfigError
from speedrun.model.families import family_of
from speedrun.model.flops import FORMULA
from speedrun.optim.build import RunOptimizer, build_optimizer
from speedrun.perf import compiled_updates
from speedrun.perf import graphs as step_graphs
from speedrun.tools.anchors import Anchor, find_anchor, load_anchors
from speedrun.train.distributed import DistContext, cuda_allocator_settings
from speedrun.train.flops import step_flops
from speedrun.train.loop import build_model
from speedrun.train.plan.memory import estimate_memory, estimate_peak_bytes
from speedrun.train.plan.precision import effective_config
from speedrun.train.plan.precision import resolve as resolve_precision
from speedrun.train.plan.run_data import RunData, micro_batch_tokens, open_loader
from speedrun.train.run.environment import peak_memory_bytes
from speedrun.train.run.tracking import datasheet_peak, device_name, format_mfu, mfu, probe_matmul_peak
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.stages import stage_bounds, stage_values
from speedrun.train.step import autocast_dtype, autocast_label, train_step
from speedrun.train.timing import wait_for_device
from speedrun.train.warmup import is_compiled, loader_at


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

    @property
    def overlap(self):
        return self.inner.overlap

    @property
    def step_graphs(self):
        return getattr(self.inner, "step_graphs", None)


def bench_stages(cfg: Config, only: list[int] | None = None) -> list[tuple[int, int, int]]:
    """(stage number, first step, steps in it) of each stage to time, in the order `only` names them (the
    GPU kit times the record's stage 3 first): a recipe's `train.stages` (1-based, the extension included
    when it has steps), else one, numbered 0, at the middle step's schedule."""
    plan = stage_plan(cfg)
    if plan is None:
        return [(0, cfg.train.steps // 2, 1)]
    found = {i + 1: (i + 1, a, b - a) for i, (a, b) in enumerate(stage_bounds(plan)) if b > a}
    return list(found.values()) if only is None else [found[n] for n in only if n in found]


def parse_stages_option(cfg: Config, text: str) -> list[int]:
    """`--stage N[,M...]`: stages of the recipe that have steps (the CLI's one check of it)."""
    numbers = [n for n, _, _ in bench_stages(cfg)]
    have = f"stages {', '.join(map(str, numbers))}" if stage_plan(cfg) else "no train.stages"
    try:
        chosen = [int(n) for n in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"--stage {text}: give stage numbers, e.g. 3 or 1,2,3 (recipe {cfg.recipe} has {have})"
        ) from None
    for n in chosen:
        if n not in numbers or n == 0:
            raise ConfigError(f"--stage {n}: recipe {cfg.recipe} has {have}")
    return chosen


def synthetic_loader(cfg: Config, ctx: DistContext, folder: Path) -> TokenLoader | DocumentLoader:
    """The run's own loader (`open_loader`: its packing, `cu_seqlens`, stage sizes) over one synthetic
    shard written in `folder`."""
    vocab = cfg.model.vocab_size
    eot = cfg.model.eot_id if cfg.model.eot_id < vocab else vocab - 1  # BPE vocabularies end with it
    shard = _synthetic_shard(cfg, folder, eot)
    data = RunData([shard], [], micro_batch_tokens(cfg, ctx.world_size), None, None, eot)  # the run's rule
    return open_loader(cfg, data, ctx)


def _synthetic_shard(cfg: Config, folder: Path, eot: int, mean_doc: int = 1000) -> Path:
    """One shard in the real format of synthetic documents of ~`mean_doc` tokens, long enough for several
    steps of the largest stage (the loaders leave a shard a batch before its end; the packed rule spends
    at least a document per row)."""
    plan = stage_plan(cfg)
    biggest = max(s.batch_tokens for s in plan.stages) if plan else cfg.train.global_batch_tokens
    n = 4 * biggest + 4 * cfg.train.document_rows * mean_doc
    path = folder / "bench_train_000000.bin"
    write_shard(path, synthetic_tokens(n, cfg.model.vocab_size, eot, mean_doc).astype(np.uint16))
    return path


def run_bench(
    cfg: Config,
    device: torch.device,
    steps: int = 10,
    warmup: int = 3,
    stages: list[int] | None = None,
    anchors: list[Anchor] | None = None,
) -> dict:
    """Time `warmup` + `steps` optimizer steps of every stage of `cfg` (or only of `stages`), each at the
    stage's own schedule and batch from the run's loader; returns the measurements (see module doc)."""
    precision = resolve_precision(cfg, device)
    cfg = effective_config(cfg, precision)  # the dtype this device runs fast, as `speedrun train` does
    plan = stage_plan(cfg)
    if device.type == "cuda":
        cuda_allocator_settings()
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=device)
    model, train_model = build_model(cfg, ctx)
    compiled = is_compiled(train_model)  # the one rule (the loop also runs it under DDP)
    optimizer = build_optimizer(model, cfg)
    if compiled:
        optimizer.feed(train_model)
    print(compiled_updates.install(optimizer, cfg.train.perf, device), file=sys.stderr)  # as train does
    # CUDA graphs (SPEEDRUN_GRAPHS, the kit's A/B): each stage's two untimed steps capture, then check
    graphs_line = step_graphs.install(optimizer, model, train_model, cfg, device, 1, compiled)
    print(graphs_line, file=sys.stderr)
    timed = _TimedOptimizer(optimizer, device)
    to_time, name = bench_stages(cfg, stages), device_name(device)
    table = load_anchors() if anchors is None else anchors
    limit = torch._dynamo.config.recompile_limit  # a graph per stage, as warm_up allows
    torch._dynamo.config.recompile_limit = max(limit, 2 * len(to_time))
    with tempfile.TemporaryDirectory(prefix="speedrun-bench-") as tmp:
        loader = synthetic_loader(cfg, ctx, Path(tmp))
        try:
            results = []
            for n, first, length in to_time:
                r = _time_stage(cfg, plan, n, first, length, model, train_model, timed, loader, steps, warmup)
                a = find_anchor(table, cfg.recipe, n)
                r["anchor"] = a.describe(name) if a else None
                r["anchor_ratio"] = a.ratio(r["step_ms"], r["tokens_per_step"]) if a else None
                r["anchor_peak_mib"] = a.peak_mib if a else None
                print(stage_line(cfg.recipe, r), file=sys.stderr, flush=True)  # a partial run still answers
                results.append(r)
        finally:
            loader.close()
            torch._dynamo.config.recompile_limit = limit
    flops_per_token = results[-1]["flops_per_token"]  # the last stage's: the run's heaviest windows
    measured = probe_matmul_peak(device, precision.autocast or torch.float32)  # >= 1 s: one to believe
    sheet = datasheet_peak(name) if device.type == "cuda" else None
    for r in results:
        r["mfu_measured_peak"] = mfu(r["flops_per_token"], r["tokens_per_s"], measured)
        r["mfu_datasheet_peak"] = mfu(r["flops_per_token"], r["tokens_per_s"], sheet) if sheet else None
    return {
        "recipe": cfg.recipe,
        "device": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "compile": compiled,
        "cuda_graphs": graphs_line,
        "autocast": autocast_label(cfg),
        "precision": precision.describe(),
        "params": sum(p.numel() for p in model.parameters()),
        "attention": cfg.model.attention,
        "accumulation_steps": loader.accumulation_steps,
        "steps_timed": steps,
        "warmup_steps": warmup,
        "flops_per_token": flops_per_token,
        "measured_peak_flops": measured,
        "datasheet_bf16_peak_flops": sheet,
        "memory_estimate_bytes": estimate_peak_bytes(cfg, 1, compiled),  # this run's compile setting
        # what the bench's own peak should be compared with: it trains, it never validates
        "memory_estimate_training_bytes": estimate_memory(cfg, 1, compiled).backward_start,
        "memory_estimate_other_bytes": estimate_peak_bytes(cfg, 1, not compiled),
        "stages": results,
        "loss_first": results[0]["loss_first"],
        "loss_last": results[-1]["loss_last"],
    }


def _time_stage(cfg, plan, number, first, length, model, train_model, timed, loader, steps, warmup) -> dict:
    """One stage: `warmup` untimed steps (they compile its graph), then `steps` timed ones, at the stage's
    steps in order (wrapping inside a short stage), each scheduled and fed as the loop does."""
    device = timed.device
    accum, dtype, clip = loader.accumulation_steps, autocast_dtype(cfg), cfg.optim.grad_clip
    after_step = family_of(model.cfg).after_step
    graphs = torch._dynamo.utils.counters["stats"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s, opt_s, losses, warmup_s, graphs_at = [], [], [], [], []
    cu_timed: list[torch.Tensor] = []  # the stage's document bounds, read after the clock (no sync)

    def next_batch():
        batch = loader.next_batch()
        if len(batch) == 3 and len(cu_timed) < 64:
            cu_timed.append(batch[2])
        return batch

    compile_peak = None  # the warm-up's peak holds the compile (inductor tunes kernels on live buffers)
    for i in range(warmup + steps):
        if i == warmup and device.type == "cuda":
            compile_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)  # the timed steps' own peak
        step = first + i % length
        if plan is not None and i % length == 0:
            loader_at(loader, step)  # the stage's batch and document cut from the loader
        sched = schedule_at(step, cfg)
        apply_schedule(sched, timed.inner, model)
        graphs_at.append(graphs["unique_graphs"])
        wait_for_device(device)
        start = time.perf_counter()
        after_step(model, step - 1)  # as the loop
        loss = train_step(train_model, timed, next_batch, accum, dtype, clip, sched.grad_scale)
        wait_for_device(device)
        if i >= warmup:
            step_s.append(time.perf_counter() - start)
            opt_s.append(timed.last_s)
        else:  # the first holds the compile: said as it ends, so a slow compile is seen, not guessed
            warmup_s.append(time.perf_counter() - start)
            print(
                f"bench: stage {number} warm-up step {i + 1} took {warmup_s[-1]:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        losses.append(float(loss))
    med, opt = statistics.median(step_s), statistics.median(opt_s)
    tokens = stage_values(first, plan).batch_tokens if plan is not None else cfg.train.global_batch_tokens
    values = stage_values(first, plan) if plan is not None else None
    new_graphs = graphs["unique_graphs"] - graphs_at[0]
    # the FLOPs the stage's steps did: its windows, and the packed rows' documents where known
    doc_lens = [int(n) for cu in cu_timed for n in cu.diff().tolist() if n > 0] or None
    windows = family_of(cfg.model).step_windows(cfg.model, schedule_at(first, cfg))
    seq_len = None if doc_lens else cfg.train.seq_len
    return {
        "stage": number,
        "first_step": first,
        "tokens_per_step": tokens,
        "windows": f"{values.short_window}/{values.long_window} blocks" if values else _window(model, sched),
        "warmup_step_s": warmup_s,
        "graphs_compiled": new_graphs,
        "graphs_compiled_timed": graphs["unique_graphs"] - graphs_at[warmup]
        if warmup < len(graphs_at)
        else 0,
        # the warm-up's time beyond its steps' own: the compile of this stage's graph(s)
        "compile_s": max(0.0, sum(warmup_s) - len(warmup_s) * med) if new_graphs else 0.0,
        "step_ms": med * 1000,
        "step_ms_min": min(step_s) * 1000,
        "forward_backward_ms": (med - opt) * 1000,
        "optimizer_ms": opt * 1000,
        "tokens_per_s": tokens / med,
        "flops_per_token": step_flops(model, windows, doc_lens, seq_len=seq_len),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
        "warmup_peak_allocated_bytes": compile_peak,
        "peak_rss_bytes": peak_memory_bytes(device) if device.type != "cuda" else None,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def stage_line(recipe: str, s: dict) -> str:
    """One line per finished stage, printed as it ends (benchmarks/gpu_check.sh collects them)."""
    peak = s["peak_allocated_bytes"]
    line = (
        f"bench-stage {recipe} stage {s['stage']}: {s['step_ms']:,.1f} ms/step, "
        f"{s['tokens_per_s']:,.0f} tok/s, "
        f"{s['graphs_compiled']} graph(s) compiled in {s['compile_s']:.1f} s, "
        f"peak {'n/a (CPU)' if peak is None else f'{peak / 2**20:,.0f} MiB allocated'}"
    )
    if s["anchor_ratio"] is not None:
        line += f"; record {s['anchor']}: ours/record {s['anchor_ratio']:.2f}x"
        if s["anchor_peak_mib"]:
            line += f"; record peak {s['anchor_peak_mib']:,} MiB allocated"
    return line


def _window(model: torch.nn.Module, sched) -> str:
    """An unstaged run's attention window: the varlen model's long one, else the schedule's (0: none)."""
    varlen = getattr(model, "varlen_windows", None)
    window = varlen.long if varlen is not None else sched.window
    return f"{window} tokens" if window else "none"


def format_bench(r: dict) -> str:
    """The human table of `run_bench`'s result: a header, then a block per stage."""
    peak = r["datasheet_bf16_peak_flops"]
    lines = [
        f"bench {r['recipe']} on {r['device']} | torch {r['torch']}, {r['threads']} threads | "
        f"compile {r['compile']} | {r['autocast']} | attention {r['attention']}",
        f"{r['params']:,} params | {r['accumulation_steps']} micro-batches a step | "
        f"{r['flops_per_token'] / 1e6:,.1f} MFLOP/token | median of {r['steps_timed']} timed steps "
        f"after {r['warmup_steps']} untimed",
        f"memory estimate (CUDA): training step {r['memory_estimate_training_bytes'] / 2**20:,.0f} MiB; "
        f"of the run with validation {r['memory_estimate_bytes'] / 2**20:,.0f} MiB "
        f"{'compiled' if r['compile'] else 'eager'}, "
        f"{r['memory_estimate_other_bytes'] / 2**20:,.0f} MiB {'eager' if r['compile'] else 'compiled'}",
    ]
    for s in r["stages"]:
        sheet = (
            f", {format_mfu(s['mfu_datasheet_peak'])} of datasheet bf16 peak {peak / 1e12:,.1f} TFLOP/s"
            if peak
            else ""
        )
        if s["peak_allocated_bytes"] is not None:
            allocated, reserved = s["peak_allocated_bytes"] / 2**30, s["peak_reserved_bytes"] / 2**30
            memory = f"{allocated:,.2f} GiB allocated, {reserved:,.2f} GiB reserved (timed steps)"
            if s["warmup_peak_allocated_bytes"]:
                memory += f"; warm-up with compile {s['warmup_peak_allocated_bytes'] / 2**30:,.2f} GiB"
        else:
            memory = f"n/a on CPU (process RSS peak {s['peak_rss_bytes'] / 2**20:,.0f} MiB)"
        compile_ = (
            f"{s['graphs_compiled']} graph(s) in {s['compile_s']:.1f} s" if s["graphs_compiled"] else "none"
        )
        if s["graphs_compiled_timed"]:
            compile_ += f"; {s['graphs_compiled_timed']} more inside the timed steps (a recompile)"
        lines += [
            f"stage {s['stage'] or '-'} (from step {s['first_step']}): {s['tokens_per_step']:,} tokens/step, "
            f"windows {s['windows']}",
            f"  step time      {s['step_ms']:9.1f} ms  (min {s['step_ms_min']:.1f}; fwd+bwd "
            f"{s['forward_backward_ms']:.1f}, optimizer {s['optimizer_ms']:.1f})",
            f"  tokens/s       {s['tokens_per_s']:9,.0f}",
            f"  compile        {compile_}",
            f"  FLOPs          {s['flops_per_token'] / 1e6:9,.1f} MFLOP/token at this stage's windows",
            f"  MFU            {format_mfu(s['mfu_measured_peak']):>9}  of the probed matmul peak "
            f"{r['measured_peak_flops'] / 1e12:,.2f} TFLOP/s (a thread's median x threads){sheet}",
            f"  peak memory    {memory}",
            f"  loss           {s['loss_first']:.3f} -> {s['loss_last']:.3f} (synthetic Zipf tokens)",
        ]
        if s["anchor"]:
            record_peak = (
                f"; record peak {s['anchor_peak_mib']:,} MiB allocated" if s["anchor_peak_mib"] else ""
            )
            lines.append(f"  record         {s['anchor']}{record_peak}")
            lines.append(f"  ours/record    {s['anchor_ratio']:9.2f}x  (time per token)")
    lines.append(f"FLOPs counted: {FORMULA}")
    return "\n".join(lines)
