"""Communication overlapping the backward (records #44, #61): each reduction of the sharded optimizer
(optim/sharded.py), a bank's reduce-scatter or an Adam gradient's reduce-scatter or all-reduce, starts
from a backward hook (`register_post_accumulate_grad_hook`) as soon as its last gradient is final,
instead of after the backward when `step` launches them all.

The plain twin is `ShardedNorMuonAdam.step`'s own launch; this changes when the collectives start, not
what they compute, so the results are the same bit for bit (tests/e2e/test_overlap.py):
- only on the last micro-batch of a step (`last_backward`, entered by train/step.py): gradients are
  final only then; the reduction reads a copy of them divided by the accumulation count and multiplied
  by the schedule's grad_scale with the same foreach ops `train_step` applies after the backward (a
  plain `Tensor.mul_` rounds the scalar to bf16 first: one ulp off on record-2026-07's bf16 banks),
  plus a gradient the optimizer kept from a skipped Adam step; the gradients themselves are left as
  the backward made them, for `train_step` to scale as before;
- in the step's own order (`ShardedNorMuonAdam.reduction_order`: banks, then the Adam rows that step
  communicates untouched), each launched once it and every reduction before it are ready, so every
  rank issues the same collectives in the same order whatever order autograd finishes them in; what a
  backward never reaches (an unused parameter) is launched by `step` as before;
- never with gradient clipping (the norm needs every gradient before any is reduced).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from speedrun.optim.sharded import ShardedNorMuonAdam
from speedrun.optim.table import Bank, Row


class BackwardReductions:
    """Hooks on every parameter of a sharded optimizer; armed by `last_backward`."""

    def __init__(self, optimizer: ShardedNorMuonAdam) -> None:
        self.optimizer = optimizer
        self.armed = False
        self.divide, self.scale = 1, 1.0
        self.ready: set[int] = set()  # ids of the parameters whose gradient is final this step
        self.order: list[tuple[Bank | Row, set[int]]] = []  # (reduction, ids of the params it needs)
        self.next = 0
        params = {id(r.param): r.param for r in optimizer.rows}
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params.values()]

    @contextlib.contextmanager
    def last_backward(self, divide: int, scale: float) -> Iterator[None]:
        """Arm the hooks for the step's last backward, whose gradients train_step then divides by
        `divide` and multiplies by `scale`."""
        self.divide, self.scale, self.ready, self.next = divide, scale, set(), 0
        self.order = [(item, _needs(item)) for item in self.optimizer.reduction_order()]
        self.armed = True
        try:
            yield
        finally:
            self.armed = False

    def finish(self, grads: Tensor) -> Tensor:
        """What train_step does to a gradient after the backward, in place on `grads` (a copy)."""
        # train_step's own ops: a foreach op multiplies bf16 by the scalar in fp32 (aten's mul_.Scalar),
        # `Tensor.mul_(0.7)` first rounds 0.7 to bf16 (mul_.Tensor): one ulp apart on record-2026-07
        if self.divide > 1:
            torch._foreach_div_([grads], self.divide)
        if self.scale != 1.0:
            torch._foreach_mul_([grads], self.scale)
        return grads

    @torch.no_grad()
    def _hook(self, param: Tensor) -> None:
        if not self.armed:
            return
        self.ready.add(id(param))
        while self.next < len(self.order) and self.order[self.next][1] <= self.ready:
            self.optimizer.launch(self.order[self.next][0], self.finish)
            self.next += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _needs(item: Bank | Row) -> set[int]:
    if isinstance(item, Bank):
        return {id(row.param) for row, _ in item.members}
    return {id(item.param)}


def wanted(mode: str, device: torch.device, world: int) -> bool:
    """`train.perf=auto` on CUDA with several processes (one has nothing to communicate). Not on the
    CPU: gloo's collectives are the test bed, not a measured win."""
    return mode == "auto" and device.type == "cuda" and world > 1


def install(optimizer: Any, mode: str, device: torch.device, world: int) -> str:
    """Hook the run's sharded optimizer (RunOptimizer's "table" part) where `wanted`; the log line."""
    table = getattr(optimizer, "parts", {}).get("table")
    if table is None or not wanted(mode, device, world):
        return f"reductions: after the backward (train.perf={mode}, {world} process{'es' * (world > 1)})"
    optimizer.overlap = BackwardReductions(table)
    return f"reductions: from backward hooks, {len(table.banks)} banks first (train.perf={mode})"
