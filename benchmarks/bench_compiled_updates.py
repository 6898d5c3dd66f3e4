"""The optimizer's share of a training step with eager and with compiled updates (speedrun/perf/
compiled_updates.py), on any device: `speedrun bench`'s own timing of a recipe, run twice in one process,
the second time with the compiled updates swapped in whatever `train.perf=auto` would decide here (on
the CPU it would not swap them: this is how that choice was measured, docs/benchmarks.md).

    python benchmarks/bench_compiled_updates.py [--recipe demo-normuon] [--device cpu] [--steps 8]
        [--warmup 2] [--stage N] [key=value ...]

Prints, per arm, the median step and optimizer ms and the optimizer's share, then compiled/eager.
"""

from __future__ import annotations

import argparse

import torch

from speedrun.perf import compiled_updates
from speedrun.recipes import load_recipe
from speedrun.tools.bench import run_bench


def arm(cfg, device: torch.device, steps: int, warmup: int, stages, compiled: bool) -> dict:
    wanted = compiled_updates.wanted
    compiled_updates.wanted = lambda mode, dev: compiled  # the swap itself is the one a run makes
    try:
        r = run_bench(cfg, device, steps=steps, warmup=warmup, stages=stages, anchors=[])
    finally:
        compiled_updates.wanted = wanted
    s = r["stages"][-1]
    return {"step_ms": s["step_ms"], "optimizer_ms": s["optimizer_ms"], "loss_last": r["loss_last"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="demo-normuon")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--stage", type=int, default=None, help="time only this stage (1 = first)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    cfg = load_recipe(args.recipe, args.overrides)
    device = torch.device(args.device)
    results = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        stages = None if args.stage is None else [args.stage]
        r = results[name] = arm(cfg, device, args.steps, args.warmup, stages, compiled)
        share = r["optimizer_ms"] / r["step_ms"]
        print(
            f"compiled-updates {args.recipe} {name:<8} step {r['step_ms']:8.1f} ms  "
            f"optimizer {r['optimizer_ms']:7.1f} ms ({share:5.1%})  last loss {r['loss_last']:.4f}  "
            f"threads {torch.get_num_threads()}",
            flush=True,
        )
    ratio = results["compiled"]["optimizer_ms"] / results["eager"]["optimizer_ms"]
    print(f"compiled-updates {args.recipe} optimizer compiled/eager {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
