"""U-Net skips (2024-11-10 on): decoder layer L-1-i adds encoder layer i's output to its input, scaled
by a learned weight w (init 1), or by sigmoid(w) with w init -1.5, σ ≈ 0.18 (record #32, 2025-09-11,
PR #125: a gate in (0, 1) cannot flip or blow up the skip). A layer with neither attention nor MLP
(#35's layer 0) is absent from the model and has no output to skip, so its partner receives none."""

from __future__ import annotations

import torch

from speedrun.config import ModelConfig
from speedrun.model.layout import attention_layers, mlp_layers


def skip_sources(cfg: ModelConfig) -> list[int | None]:
    """Per layer, the encoder layer whose output it receives (None: no skip)."""
    L = cfg.n_layer
    sources: list[int | None] = [None] * L
    if not cfg.unet:
        return sources
    present = [a or m for a, m in zip(attention_layers(cfg), mlp_layers(cfg), strict=True)]
    for i in range(L // 2):
        if present[i]:
            sources[L - 1 - i] = i
    return sources


def initial_weights(cfg: ModelConfig) -> torch.Tensor:
    """One weight per decoder layer: ones (plain), -1.5 (sigmoid, #32)."""
    return torch.full((cfg.n_layer // 2,), -1.5 if cfg.unet_gate == "sigmoid" else 1.0)


def skip_scale(weight: torch.Tensor, gate: str) -> torch.Tensor:
    """The factor of a skip: the weight itself, or sigmoid(weight) (#32)."""
    return torch.sigmoid(weight) if gate == "sigmoid" else weight
