"""CUDA graphs of the optimizer tail: each bank's NorMuon update (the sharded optimizer's `bank_update`,
optim/sharded.py: momentum, second moment, Newton–Schulz / Polar Express, the weight step; ~50 short
launches per bank) replayed as one graph per bank shape, as #92 captures its ANVIL bank updates.

What a replay reads must stay at the addresses the capture saw, and our optimizer does not keep them
(the weights are stacked per step, the warm-up's restore replaces the state tensors), so each bank key
owns static buffers: the step copies the bank's gradient, state, weights and scheduled scalars in, replays,
and copies the state it updates (momentum, second moment, bf16 mantissa) back. The scalars change every
step, so they enter as device tensors filled outside the graph, never as values a capture would bake. A
key's first call captures (after warm iterations on the side stream, on the static copies), its second
replays and checks the result and the state against the eager update run on copies (then it is the real
update); later calls only replay. Installed with the step graphs (perf/graphs.py, SPEEDRUN_GRAPHS) on a
`ShardedNorMuonAdam` whose updates are compiled (perf/compiled_updates.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

MUTATED = (1, 2, 4)  # bank_update's arguments it writes in place: momentum, second moment, mantissa
N_TENSORS, N_SCALARS = 5, 3  # grads, momentum, second moment, weights, mantissa; lr, decay, momentum
CHECK_REL = 1e-3  # replay against eager, relative to the largest magnitude (inductor may reorder sums)


@dataclass
class TailGraph:
    static: list[Tensor | None]  # the five tensors, then the three scalars as fp32 device tensors
    graph: Any
    out: Tensor
    checked: bool = False


class BankGraphs:
    """Wraps a bank update (`fn`, called as optim/sharded.py calls `bank_update`) with one graph per key."""

    def __init__(self, fn: Callable[..., Tensor], backend: Any, warm: int = 3) -> None:
        self.fn, self.backend, self.warm_iterations = fn, backend, warm
        self.graphs: dict[tuple, TailGraph] = {}
        self.sealed = False
        self.log: list[str] = []

    def key(self, args: tuple) -> tuple:
        tensors = [None if t is None else (tuple(t.shape), t.dtype) for t in args[:N_TENSORS]]
        scalars = [
            tuple(s.shape) if isinstance(s, Tensor) else () for s in args[N_TENSORS : N_TENSORS + N_SCALARS]
        ]
        return (*tensors, *scalars, *args[N_TENSORS + N_SCALARS :])

    def __call__(self, *args: Any) -> Tensor:
        key = self.key(args)
        tg = self.graphs.get(key)
        live = list(args[: N_TENSORS + N_SCALARS])  # a scalar is a float, or a tensor (per-matrix lr)
        rest = args[N_TENSORS + N_SCALARS :]
        if tg is None:
            assert not self.sealed, f"no optimizer graph for bank key {key[:5]} after the warm-up"
            tg = self._capture(key, live, rest)
            fresh = True
        else:
            fresh = False
        with torch.no_grad():
            for dst, src in zip(tg.static, live, strict=True):
                if isinstance(src, Tensor):
                    dst.copy_(src)
                elif dst is not None:
                    dst.fill_(src)  # a kernel argument, no host-to-device copy to wait for
            want = None
            if not fresh and not tg.checked:  # the eager update, on copies, from the same inputs
                copies = [t.clone() if isinstance(t, Tensor) else t for t in live]
                want = (self.fn(*copies, *rest), copies)
            tg.graph.replay()
            if want is not None:
                self._check(key, tg, *want)
            for i in MUTATED:
                if isinstance(live[i], Tensor):
                    live[i].copy_(tg.static[i])
        return tg.out

    def _capture(self, key: tuple, live: list[Tensor | None], rest: tuple) -> TailGraph:
        like = live[0]
        static = [
            t.detach().clone() if isinstance(t, Tensor)
            else None if t is None
            else torch.full((), t, dtype=torch.float32, device=like.device)
            for t in live
        ]  # fmt: skip

        def update() -> Tensor:
            return self.fn(*static, *rest)

        self.backend.warm(update, self.warm_iterations)  # on the static copies: the real state is untouched
        graph, out = self.backend.capture(update)
        self.log.append(f"optimizer graph captured: bank {key[3][0]}")
        tg = self.graphs[key] = TailGraph(static, graph, out)
        return tg

    def _check(self, key: tuple, tg: TailGraph, eager: Tensor, copies: list[Tensor | None]) -> None:
        pairs = [("update", tg.out, eager)] + [
            (f"argument {i}", tg.static[i], copies[i]) for i in MUTATED if isinstance(copies[i], Tensor)
        ]
        for what, got, want in pairs:
            worst = float((got.float() - want.float()).abs().max())
            assert worst <= CHECK_REL * float(want.float().abs().max()) + 1e-7, (
                f"optimizer graph {key[3]}: replay {what} differs from eager by {worst:.3g}"
            )
        tg.checked = True
        self.log.append(f"optimizer graph checked against eager: bank {key[3][0]}")

    def seal(self) -> None:
        unchecked = [k[3] for k, tg in self.graphs.items() if not tg.checked]
        assert not unchecked, f"optimizer graphs captured but never checked against eager: {unchecked}"
        self.sealed = True


def install(optimizer: Any, backend: Any) -> list[BankGraphs]:
    """Wrap every bank update the speed layer compiled (a part's `bank_update`); returns the wrappers."""
    out = []
    for part in getattr(optimizer, "parts", {}).values():
        if getattr(part, "bank_update", None) is not None:
            part.bank_update = BankGraphs(part.bank_update, backend)
            out.append(part.bank_update)
    return out
