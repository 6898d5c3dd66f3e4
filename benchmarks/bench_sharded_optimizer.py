"""Bytes each process sends per step, optimizer state per process and aten ops per step: the sharded
2025–26 optimizer (optim.name=normuon) against the old path (DDP all-reduce of every gradient, then
Muon's all-gather of the orthogonalized matrices), for a recipe's shapes on W simulated ranks.

No processes are started: the model lives on the meta device (shapes, no arithmetic) and the
optimizer's collectives go to a wrapper that records their sizes and returns at once. Bytes sent per
process use the ring algorithms NCCL and gloo run: reduce-scatter and all-gather of an N-byte buffer
send (W−1)/W·N, an all-reduce 2(W−1)/W·N. The old path is counted from the same shapes: DDP's
all-reduce of the fp32 gradients and Muon's all-gather buffers (its round-robin blocks padded to a
multiple of W, bf16).

    python benchmarks/bench_sharded_optimizer.py [--recipe record-2025-01] [--world 8]
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from types import SimpleNamespace

import torch

from bench_muon_ops import OpCounter
from speedrun.model.families import build_model
from speedrun.optim.build import build_optimizer, build_table_optimizer, model_rules
from speedrun.optim.rules import muon_parts
from speedrun.optim.sharded import Collectives
from speedrun.recipes import load_recipe


class CountingCollectives(Collectives):
    """Rank ``rank`` of ``world`` simulated processes: records bytes, moves nothing."""

    def __init__(self, world: int, rank: int = 0) -> None:
        self.group, self.world, self.rank = None, world, rank
        self.sent: Counter[str] = Counter()

    def _done(self) -> SimpleNamespace:
        return SimpleNamespace(wait=lambda: None)

    def reduce_scatter(self, out, inp):  # noqa: ANN001
        self.sent["reduce_scatter"] += (self.world - 1) * _nbytes(inp) // self.world
        return self._done()

    def all_reduce(self, t):  # noqa: ANN001
        self.sent["all_reduce"] += 2 * (self.world - 1) * _nbytes(t) // self.world
        return self._done()

    def all_gather(self, out, inp):  # noqa: ANN001
        self.sent["all_gather"] += (self.world - 1) * _nbytes(out) // self.world
        return self._done()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def model_on_meta(recipe: str, *overrides: str):
    cfg = load_recipe(recipe, list(overrides))
    with torch.device("meta"):
        model = build_model(cfg.model)
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    return cfg, model


def old_path(recipe: str, world: int) -> dict[str, int]:
    """DDP all-reduce of every gradient + Muon's bf16 all-gather; replicated state (Adam 2x, Muon 1x)."""
    cfg, model = model_on_meta(recipe)
    grads = sum(_nbytes(p) for p in model.parameters())
    matrices = [e for e in model_rules(model, cfg) if e.rule.rule != "adam"]
    counts: Counter[tuple[int, int]] = Counter()
    for e in matrices:
        p = e.param
        parts = muon_parts(e) if p.ndim == 2 else math.prod(p.shape[:-2])
        counts[(p.shape[-2] // (parts if p.ndim == 2 else 1), p.shape[-1])] += parts
    gather = sum(math.ceil(n / world) * world * r * c * 2 for (r, c), n in counts.items())
    opt = build_optimizer(model, cfg)
    with torch.no_grad():
        opt.step()  # creates the state
    state = sum(
        _nbytes(t)
        for o in opt.parts.values()
        for s in o.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    counter = OpCounter()
    with counter, torch.no_grad():
        opt.step()  # one process: no all-gather (steady state: buffers exist)
    return {
        "ops": sum(counter.ops.values()),
        "all_reduce": 2 * (world - 1) * grads // world,
        "all_gather": (world - 1) * gather // world,
        "state": state,
    }


def new_path(recipe: str, world: int) -> tuple[dict[str, int], Counter[str]]:
    cfg, model = model_on_meta(recipe, "optim.name=normuon", "optim.adam_every=2")
    comms = CountingCollectives(world)
    opt = build_table_optimizer(model, cfg)
    opt = type(opt)(
        opt.rows, opt.adam, muon_lr=0.02, momentum=0.95, beta2=0.95, muon_weight_decay=1.2,
        backend=cfg.optim.muon_backend, adam_every=2, comms=comms,
    )  # fmt: skip
    per_step = []
    for _ in range(2):  # step 0 skips Adam (adam_every=2), step 1 runs it
        for p in model.parameters():
            p.grad = torch.empty_like(p)
        comms.sent.clear()
        opt.step()
        per_step.append(dict(comms.sent))
    counter = OpCounter()
    opt.steps_done = 1  # count an Adam step
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    with counter:
        opt.step()
    return {"steps": per_step, "state": opt.state_bytes()}, counter.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="record-2025-01")
    parser.add_argument("--world", type=int, default=8)
    args = parser.parse_args()
    mb = 2**20
    old = old_path(args.recipe, args.world)
    new, ops = new_path(args.recipe, args.world)
    old_total = old["all_reduce"] + old["all_gather"]
    print(f"{args.recipe}, {args.world} simulated ranks, bytes sent per process per step (ring):")
    print(
        f"  old  DDP all-reduce {old['all_reduce'] / mb:,.1f} MiB + Muon all-gather "
        f"{old['all_gather'] / mb:,.1f} MiB = {old_total / mb:,.1f} MiB"
    )
    for name, sent in zip(("step without Adam", "step with Adam"), new["steps"], strict=True):
        parts = " + ".join(f"{k} {v / mb:,.1f} MiB" for k, v in sorted(sent.items()))
        print(f"  new  ({name}) {parts} = {sum(sent.values()) / mb:,.1f} MiB")
    mean = sum(sum(s.values()) for s in new["steps"]) / 2
    ratio = f" = {mean / old_total:.2f}x old" if old_total else ""
    print(f"  new  mean over two steps {mean / mb:,.1f} MiB{ratio}")
    print(
        f"optimizer state per process: old {old['state'] / mb:,.1f} MiB (replicated), "
        f"new {new['state'] / mb:,.1f} MiB"
    )
    top = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
    print(f"aten ops per optimizer step: old (Muon + Adam, one process) {old['ops']}, ")
    print(f"  new (rank 0 of {args.world}, Adam step) {sum(ops.values())} ({top}, ...)")


if __name__ == "__main__":
    main()
