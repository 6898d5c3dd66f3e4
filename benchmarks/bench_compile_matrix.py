"""Every bundled recipe (one per distinct shrunk model), compiled by inductor as CUDA compiles it
(`dynamic=False`, here `fullgraph=False` so graph breaks are counted rather than raised) on this CPU,
trained a few steps beside eager while the LR, momentum and window change. Prints per recipe: graph
breaks, compiled frames, recompiles after the first step, loss and first-step gradient differences,
and the first step's time (mostly compilation).

    PYTHONPATH=src python benchmarks/bench_compile_matrix.py [--steps 3] [--layers 2]
        [--backend inductor] [--fullgraph] [RECIPE ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ holds the shared harness

import torch  # noqa: E402
from tests.compile_matrix import check_recipe  # noqa: E402
from tests.recipe_matrix import shrunk  # noqa: E402

from speedrun.recipes import recipe_names  # noqa: E402


def distinct_models(layers: int) -> list[str]:
    """One recipe per distinct shrunk model (recipes differing only in optimizer or schedule trace the
    same graph)."""
    seen, keep = [], []
    for name in recipe_names():
        model = shrunk(name, n_layer=layers).model
        if model not in seen:
            seen.append(model)
            keep.append(name)
    return keep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help="default: one recipe per distinct shrunk model")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--fullgraph", action="store_true", help="raise on a graph break (as CUDA runs)")
    args = parser.parse_args()
    names = args.recipes or distinct_models(args.layers)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, backend {args.backend}, "
        f"{args.layers} layers, {args.steps} steps, dynamic=False, fullgraph={args.fullgraph}"
    )
    print(
        f"{'recipe':28} {'breaks':>6} {'frames':>6} {'recompiles':>10} {'loss rel err (max)':>18} "
        f"{'grad rel err':>12}  {'first step s':>12}  worst grad"
    )
    bad = 0
    for name in names:
        try:
            r = check_recipe(name, args.steps, args.layers, args.fullgraph, args.backend)
        except Exception as e:  # report every recipe
            bad += 1
            print(f"{name:28} FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            continue
        bad += bool(r["graph_breaks"] or r["recompiles_after_first_step"])
        print(
            f"{name:28} {r['graph_breaks']:>6} {r['frames']:>6} {r['recompiles_after_first_step']:>10} "
            f"{max(r['loss_rel_error']):>18.2e} {r['grad_rel_error']:>12.2e}  {r['first_step_s']:>12.1f}  "
            f"{r['worst_grad']}{' (bf16)' if r['bf16'] else ''}",
            flush=True,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
