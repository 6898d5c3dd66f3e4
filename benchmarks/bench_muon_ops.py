"""Count the aten ops one Muon `step()` dispatches for a recipe's matrices (host cost, not FLOPs).

On a GPU each dispatched op costs the host a few microseconds whatever its size, so a step of ~900
small ops can keep the GPU waiting. This counts every op that reaches the dispatcher from Python
(a TorchDispatchMode sees each top-level aten call once; ops inside a kernel are not counted) in one
steady-state step (momentum buffers already exist). The matrices live on the meta device by default:
shapes and op sequence are those of a real run, and no arithmetic is done.

    python benchmarks/bench_muon_ops.py [--recipe record-2025-01] [--device meta|cpu] [--steps 3]
                                        [--ns-form fused|2024-10-10|2024-10-14|2024-11-10]
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from speedrun.model.families import build_model
from speedrun.optim import Muon, set_muon_split
from speedrun.optim.build import model_rules
from speedrun.optim.rules import muon_parts
from speedrun.recipes import load_recipe


def cuda_launches(name: str, args: tuple) -> int:
    """Kernels CUDA launches for one op, as far as dtypes tell: a `_foreach_*` op runs one fused
    multi-tensor kernel (about one per ~100 tensors) when all its tensors share a dtype and device,
    and one kernel per tensor otherwise (the slow path); any other op: one."""
    if not name.startswith("_foreach_"):
        return 1
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    dtypes = {t.dtype for lst in lists for t in lst}
    n = len(lists[0]) if lists else 1
    return -(-n // 100) if len(dtypes) <= 1 else n


class OpCounter(TorchDispatchMode):
    """Counts aten overloads dispatched while active, and the CUDA kernels they would launch."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = str(func.overloadpacket.__name__)
        self.ops[name] += 1
        self.launches += cuda_launches(name, args)
        return func(*args, **(kwargs or {}))


def recipe_muon(recipe: str, device: str) -> Muon:
    """Muon over the recipe's block matrices with random gradients, as the run builds it."""
    cfg = load_recipe(recipe)
    with torch.device(device):
        model = build_model(cfg.model)
    o = cfg.optim
    matrices = [(e.name, e.param) for e in model_rules(model, cfg) if e.rule.rule != "adam"]
    for e in model_rules(model, cfg):
        if e.rule.rule != "adam" and e.param.ndim == 2:
            set_muon_split(e.param, muon_parts(e))
    for _, p in matrices:
        p.grad = torch.randn_like(p)
    options = {}
    if hasattr(o, "muon_momentum_form"):  # switches added with the record-fidelity work; absent before
        options = {
            "momentum_form": o.muon_momentum_form,
            "ns_form": o.muon_ns_form,
            "scale_in_update_dtype": o.muon_scale_in_bf16,
        }
    muon = Muon(
        [p for _, p in matrices],
        lr=o.muon_lr,
        momentum=o.muon_momentum,
        backend=o.muon_backend,
        ns_steps=o.muon_ns_steps,
        shape_scale=o.muon_shape_scale if o.muon_shape_scale != "none" else "ratio",
    )
    for group in muon.param_groups:
        group.update(options)
    return muon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="record-2025-01")
    parser.add_argument("--device", default="meta", help="meta (no arithmetic, default) or cpu")
    parser.add_argument("--steps", type=int, default=3, help="counted steps after one warm-up step")
    parser.add_argument("--ns-form", default="", help="override the recipe's Newton-Schulz op order")
    args = parser.parse_args()
    muon = recipe_muon(args.recipe, args.device)
    for group in muon.param_groups:
        group["ns_form"] = args.ns_form or group.get("ns_form", "fused")
    n = sum(len(g["params"]) for g in muon.param_groups)
    muon.step()  # creates the momentum buffers
    counter = OpCounter()
    with counter:
        for _ in range(args.steps):
            muon.step()
    total = sum(counter.ops.values()) / args.steps
    form = muon.param_groups[0]["ns_form"]
    print(
        f"recipe {args.recipe} (ns_form {form}): {n} Muon parameters, {total:.0f} aten ops per step(), "
        f"~{counter.launches / args.steps:.0f} CUDA kernel launches (views count as one)"
    )
    for op, count in counter.ops.most_common(12):
        print(f"  {op:32s} {count / args.steps:7.1f}")


if __name__ == "__main__":
    main()
