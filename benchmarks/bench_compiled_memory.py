"""The memory guard's compiled estimate (train/plan/memory.py) against a count of what the compiled varlen
step of each 2026 recipe keeps at its backward's start: inductor's min-cut partition traced on fake
tensors (tests/fake_compiled_memory.py), at the recipe's own micro-batch, one process. A minute or two
per recipe on a small CPU (the trace, not the size, costs).

    PYTHONPATH=src python benchmarks/bench_compiled_memory.py [RECIPE ...]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ holds the count

from tests.fake_compiled_memory import compiled_saved_bytes  # noqa: E402

from speedrun.recipes import load_recipe  # noqa: E402
from speedrun.train.plan.memory import estimate_memory  # noqa: E402

RECIPES = ["record-2026-07", "stages-2025-12", "banks-2026-01", "xsa-2026-04", "medium-2025-12"]
MiB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help=f"default: {' '.join(RECIPES)}")
    parser.add_argument("--top", type=int, default=6, help="the largest saved tensors to list")
    args = parser.parse_args()
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    print(
        "| recipe | micro-batch | saved MiB | backward MiB | guard: activations + logits (/ count) "
        "| step, 1 process: count + guard's weights, grads, state | guard (/ count) | guard, 1 of 8 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.recipes or RECIPES:
        cfg = load_recipe(name, ["train.dtype=bf16"])  # the dtype CUDA resolves to
        started = time.perf_counter()
        count = compiled_saved_bytes(cfg)
        one, eight = estimate_memory(cfg, 1, compiled=True), estimate_memory(cfg, 8, compiled=True)
        kept = count["saved"] + count["backward"]
        modelled = one.activations + one.logits
        step = kept + one.weights + one.gradients + one.optimizer
        print(
            f"| `{name}` | {cfg.train.micro_batch_tokens:,} | {count['saved'] / MiB:,.0f} | "
            f"{count['backward'] / MiB:,.0f} | {modelled / MiB:,.0f} ({modelled / kept:.2f}) | "
            f"{step / MiB:,.0f} | {one.backward_start / MiB:,.0f} ({one.backward_start / step:.2f}) | "
            f"{eight.backward_start / MiB:,.0f} |"
        )
        top = sorted(count["saved_by_op"].items(), key=lambda kv: -kv[1])[: args.top]
        print("  saved: " + "; ".join(f"{k}: {v / MiB:,.0f}" for k, v in top), file=sys.stderr)
        print(f"  ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
