"""A row-compacted Adam for a large embedding table (#92's n-gram table, track_1_short/ngram_table.py).

The plain twin is optim/cautious_adam.py's step applied to the whole table every step, rows without a
gradient stepping with g = 0:

    m ← β1·m + (1 − β1)·g;   v ← β2·v + (1 − β2)·g²     (row_moment: v one scalar per row, g² its mean)
    U ← m / (√v + ε) · lr·√(1 − β2ᵗ)/(1 − β1ᵗ);   U ← U + W·[U·W > 0]·lr²·wd;   W ← W − U

This one touches only the rows a step has gradient for (a row given several times gets their sum). Each
row remembers the step its state is current to; when a row is next touched, the steps it slept through
are replayed first, exactly as the dense step would have run them with g = 0, so the table and state equal
the dense run's. With β1 = 0 (#92) a zero-gradient step moves nothing (U = 0, and the decay is gated on
U), so the replay is only v ← v·∏β2 over the missed steps, read from a running sum of log β2 (one multiply
per row, equal to the sequential product to rounding); with β1 > 0 the missed steps are replayed one by
one (m decays, and the row moves). `lr`, β2 and wd may change per step (#92 squares β2 and doubles the
decay when its table steps every 4th step); the history keeps each step's.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from speedrun import ops


class RowAdam:
    """Compacted cautious Adam of `table` (rows, d) in place; state for every row, touched lazily."""

    def __init__(self, table: Tensor, beta1: float = 0.0, eps: float = 1e-10, row_moment: bool = True):
        self.table, self.beta1, self.eps, self.row_moment = table, float(beta1), float(eps), row_moment
        sd = torch.promote_types(table.dtype, torch.float32)  # fp32 state (fp64 for an fp64 table)
        n, d = table.shape
        self.exp_avg = torch.zeros(n, d, dtype=sd, device=table.device) if beta1 else None
        self.exp_avg_sq = torch.zeros((n,) if row_moment else (n, d), dtype=sd, device=table.device)
        self.current = torch.zeros(n, dtype=torch.int32, device=table.device)  # step each row is current to
        self.steps = 0
        self.hyper: list[tuple[float, float, float]] = [(0.0, 1.0, 0.0)]  # step s → (lr, β2, wd); 0 unused
        self.log_beta2 = [0.0]  # Σ log β2 over steps 1..s (the β1 = 0 replay), and its device copy
        self._logs = torch.zeros(64, dtype=torch.float64, device=table.device)

    @torch.no_grad()
    def step(self, rows: Tensor, grad: Tensor, lr: float, beta2: float, wd: float = 0.0) -> None:
        """One step of every row: `rows` (n,) local row ids (repeats summed) with gradient `grad` (n, d)."""
        self.steps += 1
        self.hyper.append((float(lr), float(beta2), float(wd)))
        self.log_beta2.append(self.log_beta2[-1] + math.log(beta2))
        if self.steps >= self._logs.numel():  # grown by doubling: no per-step host-to-device copy of it
            self._logs = torch.cat([self._logs, torch.zeros_like(self._logs)])
        self._logs[self.steps] = self.log_beta2[-1]
        if rows.numel() == 0:
            return
        uniq, inv = torch.unique(rows, return_inverse=True)
        g = torch.zeros(uniq.numel(), grad.shape[1], dtype=self.exp_avg_sq.dtype, device=grad.device)
        g.index_add_(0, inv, grad.to(g.dtype))
        row_adam_rows(self, uniq, g)
        self.current[uniq] = self.steps

    def bring_current(self, rows: Tensor | None = None) -> None:
        """Replay the missed steps of `rows` (default: every row) up to now, as before a save."""
        rows = torch.arange(self.table.shape[0], device=self.table.device) if rows is None else rows.unique()
        self._catch_up(rows, self.steps)
        self.current[rows] = self.steps

    def _catch_up(self, rows: Tensor, upto: int) -> None:
        """Advance the state of `rows` (distinct) through the zero-gradient steps after their `current`
        up to step `upto`."""
        last = self.current[rows].long()
        if self.beta1 == 0.0:  # only v decays: v·exp(Σ log β2 over (last, upto])
            logs = self._logs
            factor = torch.exp(logs[upto] - logs[last]).to(self.exp_avg_sq.dtype)
            self.exp_avg_sq[rows] = self.exp_avg_sq[rows] * (factor if self.row_moment else factor[:, None])
            return
        first = int(last.min()) + 1 if rows.numel() else upto + 1
        for s in range(first, upto + 1):
            sel = rows[last < s]
            self._update(sel, None, s)

    def _update(self, rows: Tensor, g: Tensor | None, s: int) -> None:
        """The dense step `s` on `rows` (distinct), gradient `g` (None: zero)."""
        lr, beta2, wd = self.hyper[s]
        b1 = self.beta1
        w = self.table[rows].to(self.exp_avg_sq.dtype)
        v = self.exp_avg_sq[rows] * beta2
        if g is not None:
            v = v + (1 - beta2) * (g.square().mean(1) if self.row_moment else g.square())
        if b1:
            m = self.exp_avg[rows] * b1
            m = m + (1 - b1) * g if g is not None else m
            self.exp_avg[rows] = m
        else:
            m = g if g is not None else torch.zeros_like(w)
        self.exp_avg_sq[rows] = v
        step_size = lr * (1 - beta2**s) ** 0.5 / (1 - b1**s)
        denom = (v.sqrt() + self.eps)[:, None] if self.row_moment else v.sqrt() + self.eps
        u = m / denom * step_size
        if wd:
            u = u + w * ((u * w) > 0) * (lr * lr * wd)
        self.table[rows] = (w - u).to(self.table.dtype)

    def state_dict(self) -> dict:
        """The state of these rows and the shared history (a sharded table's saves concatenate rows)."""
        return {
            "steps": self.steps, "hyper": list(self.hyper), "log_beta2": list(self.log_beta2),
            "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "current": self.current,
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.hyper = state["steps"], list(state["hyper"])
        self.log_beta2 = list(state["log_beta2"])
        size = max(64, 1 << len(self.log_beta2).bit_length())
        self._logs = torch.zeros(size, dtype=torch.float64, device=self.table.device)
        self._logs[: len(self.log_beta2)] = torch.tensor(self.log_beta2, dtype=torch.float64)
        for name in ("exp_avg", "exp_avg_sq", "current"):
            mine = getattr(self, name)
            if mine is not None:
                mine.copy_(state[name])


@ops.plain_op("row_adam_rows")
def row_adam_rows(opt: RowAdam, rows: Tensor, g: Tensor) -> None:
    """Step `opt.steps` of `opt` on `rows` (distinct) with their summed gradient `g` (fp32 or the state's
    dtype): the steps each row slept through replayed first, then the step (RowAdam.step's arithmetic)."""
    opt._catch_up(rows, opt.steps - 1)
    opt._update(rows, g, opt.steps)
