"""Backout (record #40, 2025-10-04, PR #140): before the final norm the model subtracts a learned share
of the residual stream as it left an earlier layer, x ← x − λ·h_k (k = 8 of 12 in the record, about
2/3 of the depth; λ starts at 0.5 and is trained by Adam as a scalar). What the first layers wrote for
the later layers' context, not for the prediction itself, is "backed out" of what the head reads."""

from __future__ import annotations

import torch
from torch import nn

from speedrun.model.labels import label


class Backout(nn.Module):
    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer
        self.lamb = label(nn.Parameter(torch.full((1,), 0.5)), "scalar")  # a 1-element vector, as smear's λ

    def forward(self, x: torch.Tensor, outputs: dict[int, torch.Tensor]) -> torch.Tensor:
        """x (B, T, C), the last layer's output → x − λ·(layer `self.layer`'s output, from `outputs`)."""
        return x - self.lamb * outputs[self.layer]
