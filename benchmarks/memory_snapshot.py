"""A CUDA memory snapshot of one training step at the start of its last micro-batch's backward, where a
training step's memory peaks (the earlier micro-batches' gradients held, the activations all there):
the step `speedrun bench` times (the run's model, optimizer, loader and schedule at the chosen stage's
first step), with `torch.cuda.memory._record_memory_history` on and `_dump_snapshot`
called from a hook on the loss, which autograd runs first in the backward. Writes OUT/snapshot.pickle
(open it at https://pytorch.org/memory_viz) and OUT/snapshot.json: allocated and reserved bytes at that
point, the step's peak, and the memory guard's estimate of it (train/plan/memory.py), with their ratio.
On a CPU it runs the same step and says "no CUDA: no snapshot" (the kit's test runs it so).

    python benchmarks/memory_snapshot.py --recipe R [--stage N] --out DIR [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from speedrun.optim.build import build_optimizer
from speedrun.recipes import load_recipe
from speedrun.tools import bench
from speedrun.train.distributed import DistContext
from speedrun.train.loop import build_model
from speedrun.train.plan.memory import estimate_memory
from speedrun.train.plan.precision import effective_config
from speedrun.train.plan.precision import resolve as resolve_precision
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.step import autocast_dtype, train_step
from speedrun.train.warmup import is_compiled, loader_at


class SnapshotAtBackward:
    """Calls the model; on call `at_call` (the step's last micro-batch: the gradients of the earlier ones
    are held by then) hooks the loss, so that backward's first act is `at_backward`."""

    def __init__(self, model: torch.nn.Module, at_backward, at_call: int):
        self.model, self.at_backward, self.at_call, self.calls = model, at_backward, at_call, 0

    def modules(self):  # the training step finds the model's per-slot parts through it
        return self.model.modules()

    def __call__(self, *args):
        loss = self.model(*args)
        self.calls += 1
        if self.calls == self.at_call:
            loss.register_hook(lambda grad: self.at_backward())
        return loss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--stage", type=int, default=None, help="stage of train.stages (default: the last timed)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = load_recipe(args.recipe, args.overrides)
    cfg = effective_config(cfg, resolve_precision(cfg, device))
    stages = bench.bench_stages(cfg, None if args.stage is None else [args.stage])
    if not stages:
        print(f"memory_snapshot: recipe {cfg.recipe} has no stage {args.stage}", file=sys.stderr)
        return 2
    number, first, _ = stages[-1]
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=device)
    model, train_model = build_model(cfg, ctx)
    optimizer = build_optimizer(model, cfg)
    apply_schedule(sched := schedule_at(first, cfg), optimizer, model)
    cuda = device.type == "cuda"
    seen: dict = {}

    def at_backward() -> None:
        if cuda:
            torch.cuda.synchronize(device)
            seen["allocated_bytes"] = torch.cuda.memory_allocated(device)
            seen["reserved_bytes"] = torch.cuda.memory_reserved(device)
            torch.cuda.memory._dump_snapshot(str(args.out / "snapshot.pickle"))
        seen["hooked"] = True

    with tempfile.TemporaryDirectory(prefix="speedrun-snapshot-") as tmp:
        loader = bench.synthetic_loader(cfg, ctx, Path(tmp))
        try:
            loader_at(loader, first)
            step = (train_model, optimizer, loader.next_batch, loader.accumulation_steps, autocast_dtype(cfg))
            train_step(*step, cfg.optim.grad_clip, sched.grad_scale)  # compiles, fills the optimizer state
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            loader_at(loader, first)
            hooked = SnapshotAtBackward(train_model, at_backward, loader.accumulation_steps)
            train_step(hooked, *step[1:], cfg.optim.grad_clip, sched.grad_scale)
            if cuda:
                torch.cuda.memory._record_memory_history(enabled=None)
                seen["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        finally:
            loader.close()
    estimate = estimate_memory(cfg, 1, is_compiled(train_model)).backward_start
    result = {
        "recipe": cfg.recipe,
        "stage": number,
        "device": str(device),
        "estimate_bytes": estimate,
        **seen,
    }
    if cuda:
        result["allocated_over_estimate"] = seen["allocated_bytes"] / estimate
    (args.out / "snapshot.json").write_text(json.dumps(result, indent=2) + "\n")
    if not cuda:
        print(
            f"memory_snapshot {cfg.recipe} stage {number}: no CUDA: no snapshot (hooked: {'hooked' in seen})"
        )
    else:
        print(
            f"memory_snapshot {cfg.recipe} stage {number}: at the backward's start "
            f"{seen['allocated_bytes'] / 2**20:,.0f} MiB allocated, "
            f"{seen['reserved_bytes'] / 2**20:,.0f} MiB reserved; "
            f"step peak {seen['peak_allocated_bytes'] / 2**20:,.0f} MiB; the guard's estimate "
            f"{estimate / 2**20:,.0f} MiB (allocated/estimate {result['allocated_over_estimate']:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
