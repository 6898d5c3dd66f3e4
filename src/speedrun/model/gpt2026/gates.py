"""The gates of the gpt2026 family, each a small matrix from zero that scales what a part adds: #28's
per-head attention-output gate, #55's value-embedding gate (per head) and skip gate (per position); #34's
smear gate is in embeddings.py. Each labels its weight where it creates it."""

from __future__ import annotations

import torch
from torch import nn

from speedrun.model.labels import label_linear
from speedrun.model.layers import CastedLinear

# Gates on the value embeddings and on the skip (record #55, 2025-12-29, PR #186): where #28's
# attention gate lets a head switch its output off, these let the context scale what two shortcuts add.
#
# - value-embedding gate: on each layer with a value embedding, v = λ0·v + g·ve with g = 2·sigmoid(W·x[:k])
#   per head and position, x the layer's normed input, W (heads, k) (k = 12), trained by NorMuon like the
#   attention gates (one statistic per head);
# - skip gate: the skip 3 → 6 (#45) adds sigmoid(w)·g·x3, g = 2·sigmoid(u·x0[:k]) per position, x0 the
#   normed embedding, u (1, k), trained by Adam at lr 0.008 × 0.05 without decay.
# Both start at zero, so g = 1 and the model starts as #54's.


class ContextGate(nn.Module):
    """2·sigmoid(W·x[..., :k]): (…, k) → (…, n), in (0, 2), 1 at the zero init."""

    def __init__(self, dims: int, n: int, label: str = "gate"):
        super().__init__()
        self.proj = label_linear(CastedLinear(dims, n, bias=False), label)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero, as the record (GPT._init_weights calls this again after its own init)."""
        nn.init.zeros_(self.proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * torch.sigmoid(self.proj(x[..., : self.proj.in_features]))


# Sparse attention gate (record #28, 2025-08-23, PR #117): each head's attention output is multiplied by
# sigmoid(W·x[:k]), x the layer's normed input, W (heads, k) a small matrix (k = 12 in the records,
# trained by Muon like the other block matrices) that starts at zero, so every gate starts at one half. A
# head can thus switch itself off where the context says it has nothing to add (a learned no-op).


class AttentionGate(ContextGate):
    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (B, H, T, D) gated per head and position by x (B, T, C): sigmoid, not ContextGate's 2·sigmoid."""
        gate = torch.sigmoid(self.proj(x[..., : self.proj.in_features]))  # (B, T, H)
        return y * gate.transpose(1, 2)[..., None]


class ValueEmbedGate(ContextGate):
    """#55: per head, the share of the value embedding added to v. With `ve_dims` (#70, 2026-02-03, PR
    #218: 6, on the unpaired layers) the gate reads x[..., :k − ve_dims] and the embedding's first ve_dims
    dims, `cat([x[..., :6], ve[..., :6]])`, instead of x[..., :k]."""

    def __init__(self, dims: int, n: int, ve_dims: int = 0):
        super().__init__(dims, n)
        assert 0 <= ve_dims < dims
        self.ve_dims = ve_dims

    def gate(self, ve: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """ve (B, T, H, D) scaled per head by the gate of x (B, T, C) (and of ve's first dims, #70)."""
        if self.ve_dims:
            k = self.proj.in_features - self.ve_dims
            x = torch.cat([x[..., :k], ve.flatten(-2)[..., : self.ve_dims].type_as(x)], dim=-1)
        return self(x)[..., None] * ve


def skip_gates(dims: int, skips: int) -> nn.Module:
    """#55's one gate for its one skip, a factor per position read from the normed embedding x0 (B, T, C)
    → (B, T, 1); one gate per skip where there are several (the medium record's three, each with its own
    weight and λ), indexed like the skips."""
    made = [ContextGate(dims, 1, "skip_gate") for _ in range(skips)]
    return made[0] if skips == 1 else nn.ModuleList(made)


def skip_gate_of(gate: nn.Module, index: int) -> nn.Module:
    """The gate of skip `index` (skip_gates' one gate serves its one skip)."""
    return gate[index] if isinstance(gate, nn.ModuleList) else gate
