"""How gpt2026 layers reach each other besides the residual stream: the x0 shortcut with its residual
weight from 1.1 (#45) and its own x0 weight (#52), skips from an earlier layer's output scaled by a weight
or sigmoid(w) (#32, U-Net pairs then #45's 3 → 6) and #55's context gate, and #40's backout."""

from __future__ import annotations

import torch
from torch import nn

from speedrun.model.labels import label


def x0_lambdas(
    resid_init: float, apart: bool, embed2: bool = False
) -> tuple[nn.Parameter, nn.Parameter | None]:
    """(lambdas, x0_lambda): [λ0, λ1] in one vector, or [λ0] and λ1 apart (#52); with `embed2` (the
    medium record's second embedding) the apart x0 weights are a pair, [x0's, the second embedding's]."""
    if apart:
        return label(nn.Parameter(torch.tensor([resid_init])), "scalar"), label(
            nn.Parameter(torch.zeros(2 if embed2 else 1)), "x0"
        )
    assert not embed2, "config checks: model.embed2 needs x0_lambda_apart"
    return label(nn.Parameter(torch.tensor([resid_init, 0.0])), "scalar"), None


def sublayer_lambdas(resid_init: float) -> tuple[nn.Parameter, nn.Parameter]:
    """#77 (2026-03-06, SimplifyHC): per layer (resid, post) for its attention and MLP sublayers,
    x ← r·x + p·f(norm(x)); resid from √resid_init each (1.1 per layer, as #45), post from 1."""
    resid = label(nn.Parameter(torch.full((2,), resid_init**0.5)), "resid_lambda")
    return resid, label(nn.Parameter(torch.ones(2)), "lambda")


def skip_weights(n: int, form: str) -> nn.Parameter:
    """One weight per skip: 1 (a plain weight) or -1.5 (sigmoid form, #32: σ ≈ 0.18)."""
    return label(nn.Parameter(torch.full((n,), -1.5 if form == "sigmoid" else 1.0)), "scalar")


def skip_scale(weight: torch.Tensor, form: str) -> torch.Tensor:
    return torch.sigmoid(weight) if form == "sigmoid" else weight


# Backout (record #40, 2025-10-04, PR #140): before the final norm the model subtracts a learned share
# of the residual stream as it left an earlier layer, x ← x − λ·h_k (k = 8 of 12 in the record, about
# 2/3 of the depth; λ starts at 0.5 and is trained by Adam as a scalar). What the first layers wrote for
# the later layers' context, not for the prediction itself, is "backed out" of what the head reads.


class Backout(nn.Module):
    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer
        self.lamb = label(nn.Parameter(torch.full((1,), 0.5)), "scalar")  # a 1-element vector, as smear's λ

    def forward(self, x: torch.Tensor, outputs: dict[int, torch.Tensor]) -> torch.Tensor:
        """x (B, T, C), the last layer's output → x − λ·(layer `self.layer`'s output, from `outputs`)."""
        return x - self.lamb * outputs[self.layer]
