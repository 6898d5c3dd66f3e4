"""Compiled optimizer updates: the per-bank NorMuon update (optim/normuon.normuon_update, the eager
pieces `normuon_direction` and `stepped_weights` the optimizer runs, composed) and Muon's
orthogonalization (optim/orthogonalize.orthogonalize) under `torch.compile(fullgraph=True,
dynamic=False)`, as upstream compiles its update ("the next step" of docs/roadmap.md). ANVIL (a
subclass with its own direction, optim/anvil.py) keeps its eager update.

One graph per bank (or Muon bucket) for the whole run: the schedule's scalars (lr, decay, momentum)
change every step, so they enter as 0-dim fp32 tensors on the device, refilled each call, never as
Python numbers a graph would specialize on. The compiled update equals the eager one to rounding, not
bit for bit: the eager twin rounds `1 − μ` from a double, the graph computes it in fp32 from fp32 μ,
and inductor fuses the elementwise tail and reorders the NorMuon reductions
(tests/unit/test_compiled_updates.py
states the tolerance). So `install` swaps it in only where it is meant to win (`train.perf=auto` on
CUDA); `off`, and any CPU run, keep the eager twin, bit for bit the optimizer's own code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from speedrun.optim.muon import Muon, muon_split
from speedrun.optim.normuon import normuon_update
from speedrun.optim.orthogonalize import orthogonalize
from speedrun.optim.sharded import ShardedNorMuonAdam

SCALARS = ("lr", "decay", "momentum")  # normuon_update's arguments 5, 6, 7 (after the five tensors)


class CompiledBankUpdate:
    """`normuon_update`, compiled, with its three scheduled scalars as 0-dim device tensors."""

    def __init__(self) -> None:
        self.fn = torch.compile(normuon_update, fullgraph=True, dynamic=False)
        self.scalars: dict[tuple[str, torch.device], Tensor] = {}

    def scalar(self, name: str, value: Tensor | float, device: torch.device) -> Tensor:
        """`value` as a 0-dim fp32 tensor on `device` (a tensor, per-matrix lr, is passed through). The
        fill is a device write ordered on the stream, no host sync; banks share one tensor per name
        because each bank's graph has read it before the next fill runs."""
        if isinstance(value, Tensor):
            return value
        t = self.scalars.get((name, device))
        if t is None:
            t = self.scalars[(name, device)] = torch.empty((), dtype=torch.float32, device=device)
        return t.fill_(value)

    def __call__(self, *args: Any) -> Tensor:
        tensors, scalars, static = args[:5], args[5:8], args[8:]
        device = tensors[0].device
        scalars = tuple(self.scalar(n, v, device) for n, v in zip(SCALARS, scalars, strict=True))
        return self.fn(*tensors, *scalars, *static)


def compiled_orthogonalize():
    """Muon's orthogonalization, compiled (its arguments other than the matrices are constants)."""
    return torch.compile(orthogonalize, fullgraph=True, dynamic=False)


def block_shape(p: Tensor) -> tuple[int, int]:
    """The (rows, cols) of the matrices Muon orthogonalizes in `p` (optim/muon._blocks)."""
    if p.ndim == 2:
        return p.shape[0] // muon_split(p), p.shape[1]
    return tuple(p.shape[-2:])


def wanted(mode: str, device: torch.device) -> bool:
    """Whether this run compiles its optimizer updates: `train.perf=auto` on CUDA (docs/benchmarks.md:
    on the CPU the demo's optimizer share does not shrink enough to pay for the compile)."""
    return mode == "auto" and device.type == "cuda"


def install(optimizer: Any, mode: str, device: torch.device) -> str:
    """Swap the compiled updates into the run's optimizer parts (a RunOptimizer's `parts`) where
    `wanted`; returns the log line saying which."""
    if not wanted(mode, device):
        return f"optimizer updates: eager (train.perf={mode}, device {device.type})"
    done = []
    for part in optimizer.parts.values():
        if type(part) is ShardedNorMuonAdam and part.banks:  # a subclass (ANVIL) has its own direction
            part.bank_update = CompiledBankUpdate()
            graphs = len(part.banks)
            done.append(f"NorMuon per bank ({graphs} graphs)")
        elif isinstance(part, Muon):
            part.orthogonalize = compiled_orthogonalize()
            graphs = sum(len({block_shape(p) for p in g["params"]}) for g in part.param_groups)
            done.append("Muon's orthogonalization")
        else:
            continue
        limit = torch._dynamo.config.recompile_limit  # one entry per bank shape, all on one function
        torch._dynamo.config.recompile_limit = max(limit, graphs + 1)
    what = ", ".join(done) if done else "nothing to compile"
    return f"optimizer updates: compiled ({what}; train.perf={mode})"
