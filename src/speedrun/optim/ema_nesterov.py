"""Track 3's EMA-Nesterov outer wrapper (record #46, 2026-06-19, PR #328: ``EMA_Nesterov``): a lookahead
along an EMA of the weights' recent displacement, around every inner optimizer, on every parameter.

With W_prev the weights after the previous step's update (before any lookahead) and B zero at first:

    before step s's forward:  W ← W + a·r·B   where start < s + 1 and s < end     (the lookahead)
    after step s's update:    B ← lerp(B, W − W_prev, 1 − β);  W_prev ← W         (accumulate)

a = `optim.ema_nesterov_step` (#46: 0.3), r = the first Adam group's LR over its peak (the schedule's
cool-down carries into the lookahead), β = `optim.ema_nesterov_beta` (0.99), start and end the steps
`optim.ema_nesterov_start` / `_end` (#46: 300 and 2,900 − 950 = 1,950). W − W_prev includes the
lookahead, as the record's does. The run applies step s's lookahead right after step s − 1's update
(the next forward is step s's), so validation before step s reads W_prev: the weights the record
validates (`readout`). Each function computes in the parameters' dtype (fp64 for fp64 weights:
tests/fidelity/test_ema_nesterov.py compares with the record's class in fp64).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from speedrun.optim.tail_ema import weights_set_to


class EmaNesterov:
    """The buffers of one run's parameters and the step count; the inner optimizers step outside."""

    def __init__(self, params: list[Tensor], step: float, beta: float, start: int, end: int) -> None:
        assert step > 0 and 0 <= beta < 1 and 0 <= start, "config checks: a valid EMA-Nesterov"
        self.params = list(params)
        self.step_size, self.beta, self.start, self.end = step, beta, start, end
        self.prev = [p.detach().clone() for p in self.params]
        self.buf = [torch.zeros_like(p) for p in self.params]
        self.steps = 0  # updates taken (the record's `it`)
        self.pending = False  # the weights hold a lookahead that validation must not see

    def active(self, step: int) -> bool:
        """Whether step `step` (0-based) starts with a lookahead (the record's nesterov_step test)."""
        return step + 1 > self.start and step < self.end

    @torch.no_grad()
    def after_update(self, lr_ratio: float) -> None:
        """After the inner optimizers stepped (update `self.steps`): fold W − W_prev into B, then make
        the next step's lookahead with `lr_ratio` (its first Adam group's LR over its peak, now)."""
        for p, prev, buf in zip(self.params, self.prev, self.buf, strict=True):
            buf.lerp_(p - prev, 1 - self.beta)
            prev.copy_(p)
        self.steps += 1
        self.pending = self.active(self.steps)
        if self.pending:
            for p, buf in zip(self.params, self.buf, strict=True):
                p.add_(buf, alpha=self.step_size * lr_ratio)

    @contextlib.contextmanager
    def readout(self) -> Iterator[None]:
        """Within the block the weights are W_prev (without the pending lookahead), restored after."""
        if not self.pending:
            yield
            return
        with weights_set_to(self.params, self.prev):
            yield

    def state_dict(self) -> dict:
        return {"prev": self.prev, "buf": self.buf, "steps": self.steps, "pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for mine, theirs in zip(self.prev + self.buf, state["prev"] + state["buf"], strict=True):
                mine.copy_(theirs)
        self.steps, self.pending = int(state["steps"]), bool(state["pending"])
