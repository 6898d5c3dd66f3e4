"""Smear (record #34, 2025-09-18, PR #130): each token's embedding takes in a gated share of the
previous token's, x[t] += λ·sigmoid(W·x[t, :k])·x[t-1] for t >= 1, before the embedding norm. W (1, k)
(k = 12 in the record) starts at zero and is trained by Muon like the block matrices; λ (a scalar,
trained by Adam) starts at zero, so the model starts without smear. A cheap one-token look-back: the
first layer no longer needs attention for bigrams (#35 drops it). The record smears across the
documents packed in a row (a document's first token takes from the last token of the one before)."""

from __future__ import annotations

import torch
from torch import nn

from speedrun.model.labels import label, label_linear
from speedrun.model.layers import CastedLinear


class Smear(nn.Module):
    def __init__(self, dims: int):
        super().__init__()
        self.gate = label_linear(CastedLinear(dims, 1, bias=False), "smear_gate")
        self.lamb = label(nn.Parameter(torch.zeros(1)), "scalar")
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero, as the record (GPT._init_weights calls this again after its own init)."""
        nn.init.zeros_(self.gate.weight)

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C) token embeddings → smeared; `prev` (B, 1, C): the embedding of the token before
        x[:, 0] (cached decoding), None when x starts the sequence (its first token is left alone)."""
        if prev is not None:
            return self(torch.cat([prev, x], dim=1))[:, 1:]
        k = self.gate.in_features
        g = self.lamb * torch.sigmoid(self.gate(x[:, 1:, :k]))
        return torch.cat([x[:, :1], x[:, 1:] + g * x[:, :-1]], dim=1)
