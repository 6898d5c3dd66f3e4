"""Track 3's Tail-EMA readout (records #45/#46, PR #325/#328): an EMA of the weights over the cooldown
tail, blended in only for validation; training never sees it.

After optimizer step s (s + 1 steps taken), while ``start <= s + 1 < end``: the first time the EMA is the
weights, afterwards ``ema += (w − ema)/tau``. Validation then evaluates ``(1 − lam)·w + lam·ema`` for every
parameter that has an EMA (all but those labelled ``embed``: #46 leaves the token embedding out) and puts
the weights back. #46: start 2,400, end 2,900, tau 150, lam 0.6.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from speedrun.model.labels import labelled


class TailEMA:
    """The EMA buffers of one model's parameters (fp32, fp64 for fp64 weights), created lazily."""

    def __init__(self, model: nn.Module, start: int, end: int, tau: float, lam: float) -> None:
        assert tau > 0 and 0 <= lam <= 1 and start < end, "config checks: a valid Tail-EMA"
        self.params = [p for _, p, lab in labelled(model) if lab is None or lab.name != "embed"]
        self.start, self.end, self.tau, self.lam = start, end, tau, lam
        self.ema: list[Tensor] | None = None

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """Fold the weights in after optimizer step `step` (0-based) when it falls in the tail."""
        if not self.start <= step + 1 < self.end:
            return
        if self.ema is None:
            self.ema = [p.detach().to(_work(p.dtype)).clone() for p in self.params]
            return
        for e, p in zip(self.ema, self.params, strict=True):
            e.add_(p.detach().to(e.dtype) - e, alpha=1.0 / self.tau)

    @contextlib.contextmanager
    def readout(self) -> Iterator[bool]:
        """Within the block the weights are the blend (yields True), or untouched before the tail
        (yields False); they are restored exactly afterwards."""
        if self.ema is None:
            yield False
            return
        pairs = zip(self.params, self.ema, strict=True)  # one blended tensor alive at a time, as before
        blend = (((1.0 - self.lam) * p.detach().to(e.dtype) + self.lam * e).to(p.dtype) for p, e in pairs)
        with weights_set_to(self.params, blend):
            yield True

    def state_dict(self) -> dict[str, object]:
        return {"ema": self.ema}

    def load_state_dict(self, state: dict[str, object]) -> None:
        ema = state["ema"]
        assert ema is None or len(ema) == len(self.params), "a Tail-EMA state of another model"
        self.ema = None if ema is None else [e.to(p.device) for e, p in zip(ema, self.params, strict=True)]


@contextlib.contextmanager
def weights_set_to(params: list[Tensor], values: Iterable[Tensor]) -> Iterator[None]:
    """Within the block `params` hold `values` (of their dtypes); they are restored exactly after.
    `values` is read one tensor at a time, so a generator costs one tensor beside the stash, not a model."""
    stash = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            torch._foreach_copy_(params, stash)


def _work(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
