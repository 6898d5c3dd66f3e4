"""Sparse attention gate (record #28, 2025-08-23, PR #117): each head's attention output is multiplied by
sigmoid(W·x[:k]), x the layer's normed input, W (heads, k) a small matrix (k = 12 in the records,
trained by Muon like the other block matrices) that starts at zero, so every gate starts at one half. A
head can thus switch itself off where the context says it has nothing to add (a learned no-op)."""

from __future__ import annotations

import torch
from torch import nn

from speedrun.model.labels import label_linear
from speedrun.model.layers import CastedLinear


class AttentionGate(nn.Module):
    def __init__(self, dims: int, n_head: int):
        super().__init__()
        self.proj = label_linear(CastedLinear(dims, n_head, bias=False), "gate")
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero, as the record (GPT._init_weights calls this again after its own init)."""
        nn.init.zeros_(self.proj.weight)

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (B, H, T, D) gated per head and position by x (B, T, C)."""
        gate = torch.sigmoid(self.proj(x[..., : self.proj.in_features]))  # (B, T, H)
        return y * gate.transpose(1, 2)[..., None]
