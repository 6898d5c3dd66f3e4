"""U-Net skips (2024-11-10 on): decoder layer L-1-i adds encoder layer i's output to its input, scaled
by a learned weight w (init 1). The sigmoid gate (#32), the absent layer (#35) and #45's explicit skips
are the gpt2026 family's (model/gpt2026/connections.py)."""

from __future__ import annotations

import torch

from speedrun.config import ModelConfig


def skip_sources(cfg: ModelConfig) -> list[int | None]:
    """Per layer, the encoder layer whose output it receives (None: no skip)."""
    L = cfg.n_layer
    sources: list[int | None] = [None] * L
    if cfg.unet:
        for i in range(L // 2):
            sources[L - 1 - i] = i
    return sources


def initial_weights(cfg: ModelConfig) -> torch.Tensor:
    """One weight per decoder layer, from 1."""
    return torch.ones(cfg.n_layer // 2)
