"""Time full-size training steps of a record recipe on generated shards (for a GPU session).

Writes shards in the real format (uint16 tokens drawn from a Zipf law, documents of geometric length
starting with the end-of-text token, like FineWeb's ~1,000-token average), builds the recipe's model
and optimizer exactly as `speedrun train` does (compile per `train.compile`, FlexAttention on CUDA),
then runs `--warmup` untimed and `--steps` timed optimizer steps of `train.global_batch_tokens` tokens.

Prints per step: loss, forward+backward ms, optimizer ms; then the medians, tokens/s, MFU against the
measured bf16 matmul peak (CUDA) and peak memory, and one JSON line with the same numbers.

    python benchmarks/bench_record_step.py --recipe record-2025-01 --steps 20
    python benchmarks/bench_record_step.py --recipe flex-2024-11 --window-frac 0.5 model.attention=sdpa
    python benchmarks/bench_record_step.py --device cpu --steps 2 --warmup 1 model.n_layer=4 ...  # smoke test
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from speedrun.config import Config
from speedrun.data.loader import TokenLoader
from speedrun.data.shards import write_shard
from speedrun.recipes import load_recipe
from speedrun.train.distributed import DistContext
from speedrun.train.loop import build_model
from speedrun.train.optimizers import RunOptimizer, build_optimizer
from speedrun.train.schedule import apply_schedule, schedule_at, window_tokens
from speedrun.train.step import autocast_dtype, train_step
from speedrun.train.timing import wait_for_device


class OptimizerTimer:
    """The run's optimizer with its `step()` timed (device work included), so that one `train_step`
    call splits into forward+backward and optimizer time. The waits cost only this benchmark."""

    def __init__(self, optimizer: RunOptimizer, device: torch.device):
        self.optimizer, self.device, self.last_step_s = optimizer, device, 0.0
        self.param_groups, self.parameters = optimizer.param_groups, optimizer.parameters
        self.zero_grad = optimizer.zero_grad

    def step(self) -> None:
        wait_for_device(self.device)
        start = time.perf_counter()
        self.optimizer.step()
        wait_for_device(self.device)
        self.last_step_s = time.perf_counter() - start


def generate_shard(
    path: Path, n_tokens: int, vocab_size: int, eot_id: int, mean_doc: int, seed: int = 0
) -> None:
    """Zipf-distributed tokens (rank r has probability ∝ 1/(r + 10), as in natural text, so the loss has
    something to learn) in documents of geometric length (mean `mean_doc`), each starting with `eot_id`."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / (np.arange(vocab_size) + 10.0)
    ids = rng.permutation(vocab_size)
    tokens = ids[rng.choice(vocab_size, size=n_tokens, p=weights / weights.sum())]
    tokens[tokens == eot_id] = (eot_id + 1) % vocab_size
    starts = np.cumsum(rng.geometric(1.0 / mean_doc, size=n_tokens // max(1, mean_doc) * 2 + 2))
    tokens[0] = eot_id
    tokens[starts[starts < n_tokens]] = eot_id
    write_shard(path, tokens)


def matmul_peak_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float | None:
    """Measured dense bf16 matmul throughput (the MFU denominator), or None off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def run(
    cfg: Config, steps: int, warmup: int, window_frac: float, data_dir: Path, mean_doc: int = 1000
) -> dict:
    """Time `steps` optimizer steps of `cfg` after `warmup` untimed ones; returns the measurements."""
    t, m = cfg.train, cfg.model
    device = torch.device("cuda" if t.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    shard = data_dir / "bench_train_000000.bin"
    generate_shard(shard, (steps + warmup) * t.global_batch_tokens + 1, m.vocab_size, m.eot_id, mean_doc)
    loader = TokenLoader(
        [shard],
        t.global_batch_tokens,
        t.micro_batch_tokens,
        t.seq_len,
        vocab_size=m.vocab_size,
        device=device,
    )
    model, train_model = build_model(cfg, DistContext(0, 0, 1, device))
    optimizer = OptimizerTimer(build_optimizer(model, cfg), device)
    use_compile = train_model is not model
    window = window_tokens(round(window_frac * t.steps), t.steps, m)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rows = []
    for step in range(warmup + steps):
        apply_schedule(replace(schedule_at(step, cfg), window=window), optimizer, model)
        wait_for_device(device)
        start = time.perf_counter()
        loss = train_step(
            train_model, optimizer, loader.next_batch, loader.accumulation_steps, autocast_dtype(cfg)
        )
        wait_for_device(device)
        end = time.perf_counter()
        optim_s = optimizer.last_step_s
        row = {
            "step": step + 1,
            "loss": loss.item(),
            "fwd_bwd_ms": 1000 * (end - start - optim_s),
            "optim_ms": 1000 * optim_s,
            "timed": step >= warmup,
        }
        rows.append(row)
        print(
            f"step {row['step']:>3} | loss {row['loss']:.4f} | fwd+bwd {row['fwd_bwd_ms']:8.1f} ms | "
            f"optim {row['optim_ms']:7.1f} ms{'' if row['timed'] else ' (warm-up)'}",
            flush=True,
        )
    timed = [r for r in rows if r["timed"]]
    step_ms = statistics.median(r["fwd_bwd_ms"] + r["optim_ms"] for r in timed)
    tokens_per_s = t.global_batch_tokens / (step_ms / 1000)
    flops = model.flops_per_token(t.seq_len)
    peak = matmul_peak_tflops(device)
    mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "recipe": cfg.recipe,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "compile": use_compile,
        "attention": m.attention,
        "window": window,
        "steps": steps,
        "tokens_per_step": t.global_batch_tokens,
        "micro_batches": loader.accumulation_steps,
        "step_ms": step_ms,
        "fwd_bwd_ms": statistics.median(r["fwd_bwd_ms"] for r in timed),
        "optim_ms": statistics.median(r["optim_ms"] for r in timed),
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops,
        "tflops": flops * tokens_per_s / 1e12,
        "matmul_peak_tflops": peak,
        "mfu": flops * tokens_per_s / 1e12 / peak if peak else None,
        "peak_memory_mib": mem / 2**20 if mem is not None else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="record-2025-01")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--window-frac",
        type=float,
        default=1.0,
        help="position in the recipe's run whose window is used (1.0 = the final, largest one)",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--mean-doc", type=int, default=1000, help="mean generated document length (tokens)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    cfg = load_recipe(args.recipe, [*args.overrides, f"train.device={args.device}"])
    with tempfile.TemporaryDirectory() as tmp:
        result = run(cfg, args.steps, args.warmup, args.window_frac, Path(tmp), args.mean_doc)
    mfu = (
        f"{100 * result['mfu']:.1f}% of {result['matmul_peak_tflops']:.0f} TFLOP/s"
        if result["mfu"]
        else "n/a"
    )
    mem = (
        f"{result['peak_memory_mib']:,.0f} MiB"
        if result["peak_memory_mib"]
        else f"RSS {result['peak_rss_mib']:,.0f} MiB"
    )
    print(
        f"{result['recipe']} on {result['device']}: step {result['step_ms']:.1f} ms "
        f"(fwd+bwd {result['fwd_bwd_ms']:.1f}, optim {result['optim_ms']:.1f}) | "
        f"{result['tokens_per_s']:,.0f} tok/s | MFU {mfu} | peak {mem} | "
        f"loss {result['first_loss']:.3f} -> {result['last_loss']:.3f}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
