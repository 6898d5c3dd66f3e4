"""Time one optimizer step on the GPT-2 124M matrix set: Muon (each backend) vs torch AdamW.

The set is 12 layers × {q, k, v, o: 768×768; MLP up 3072×768; MLP down 768×3072} (85M weights),
the matrices Muon owns in the speedrun. Gradients are random and fixed; each timed step is the
optimizer alone (no forward/backward). Prints warm-up-excluded median and min in milliseconds.

    python benchmarks/bench_optimizer.py [--device cpu|cuda] [--steps N] [--warmup N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from speedrun.optim import Muon


def gpt2_matrices(device: torch.device, n_layer: int = 12, d: int = 768) -> list[torch.nn.Parameter]:
    """fp32 weights with fixed random gradients, shaped like GPT-2 small's hidden-layer matrices."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]
    params = []
    for _ in range(n_layer):
        for shape in shapes:
            p = torch.nn.Parameter(torch.randn(shape, generator=gen).mul_(0.02).to(device))
            p.grad = torch.randn(shape, generator=gen).to(device)
            params.append(p)
    return params


def time_step(step: Callable[[], object], device: torch.device, steps: int, warmup: int) -> list[float]:
    """Per-step wall times in ms after ``warmup`` untimed steps (CUDA is synchronized around each)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default, help=f"torch device (default: {default})")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default: 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps (default: 2)")
    args = parser.parse_args()
    device = torch.device(args.device)
    params = gpt2_matrices(device)
    n_weights = sum(p.numel() for p in params)

    candidates: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "Muon newton_schulz": lambda: Muon(params, lr=0.02, backend="newton_schulz"),
        "Muon polar_express": lambda: Muon(params, lr=0.02, backend="polar_express"),
        "torch AdamW": lambda: torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0),
    }
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{len(params)} matrices, {n_weights / 1e6:.1f}M weights")
    print(f"{args.warmup} warm-up + {args.steps} timed steps")
    print(f"{'optimizer':<20} {'median ms':>10} {'min ms':>10}")
    for name, make in candidates.items():
        optimizer = make()
        times = time_step(optimizer.step, device, args.steps, args.warmup)
        print(f"{name:<20} {statistics.median(times):>10.1f} {min(times):>10.1f}")
        del optimizer


if __name__ == "__main__":
    main()
