"""How gpt2026 layers reach each other besides the residual stream: the x0 shortcut with its residual
weight from 1.1 (#45) and its own x0 weight (#52), skips from an earlier layer's output scaled by a weight
or sigmoid(w) (#32, U-Net pairs then #45's 3 → 6) and #55's context gate, and #40's backout."""

from __future__ import annotations

import torch
from torch import nn

from speedrun.model.backout import Backout
from speedrun.model.labels import label


def x0_lambdas(resid_init: float, apart: bool) -> tuple[nn.Parameter, nn.Parameter | None]:
    """(lambdas, x0_lambda): [λ0, λ1] in one vector, or [λ0] and λ1 apart (#52)."""
    if apart:
        return label(nn.Parameter(torch.tensor([resid_init])), "scalar"), label(
            nn.Parameter(torch.zeros(1)), "x0"
        )
    return label(nn.Parameter(torch.tensor([resid_init, 0.0])), "scalar"), None


def skip_weights(n: int, form: str) -> nn.Parameter:
    """One weight per skip: 1 (a plain weight) or -1.5 (sigmoid form, #32: σ ≈ 0.18)."""
    return label(nn.Parameter(torch.full((n,), -1.5 if form == "sigmoid" else 1.0)), "scalar")


def skip_scale(weight: torch.Tensor, form: str) -> torch.Tensor:
    return torch.sigmoid(weight) if form == "sigmoid" else weight


def backout(layer: int) -> Backout:
    """#40: x − λ·h_layer before the final norm, λ from 0.5."""
    b = Backout(layer)
    label(b.lamb, "scalar")
    return b
