"""U-Net skips (2024-11-10 on): decoder layer L-1-i adds encoder layer i's output to its input, scaled
by a learned weight w (init 1), or by sigmoid(w) with w init -1.5, σ ≈ 0.18 (record #32, 2025-09-11,
PR #125: a gate in (0, 1) cannot flip or blow up the skip). A layer with neither attention nor MLP
(#35's layer 0) is absent from the model and has no output to skip, so its partner receives none.
Record #45 (2025-11-18, PR #159) keeps one skip, layer 3's output into layer 6's input
(`model.skips = "3>6"`): explicit pairs replace the mirrored ones, one weight each, in their order."""

from __future__ import annotations

import torch

from speedrun.config import ModelConfig
from speedrun.model.layout import attention_layers, mlp_layers


def explicit_skips(text: str) -> list[tuple[int, int]]:
    """`model.skips` "SRC>DST,…" → [(src, dst), …] (config_checks validates the text first)."""
    return [(int(a), int(b)) for a, b in (pair.split(">") for pair in text.split(",") if pair.strip())]


def skip_sources(cfg: ModelConfig) -> list[int | None]:
    """Per layer, the encoder layer whose output it receives (None: no skip)."""
    L = cfg.n_layer
    sources: list[int | None] = [None] * L
    if not cfg.unet:
        return sources
    if cfg.skips:
        for src, dst in explicit_skips(cfg.skips):
            sources[dst] = src
        return sources
    present = [a or m for a, m in zip(attention_layers(cfg), mlp_layers(cfg), strict=True)]
    for i in range(L // 2):
        if present[i]:
            sources[L - 1 - i] = i
    return sources


def initial_weights(cfg: ModelConfig) -> torch.Tensor:
    """One weight per decoder layer (or per explicit skip): ones (plain), -1.5 (sigmoid, #32)."""
    n = len(explicit_skips(cfg.skips)) if cfg.skips else cfg.n_layer // 2
    return torch.full((n,), -1.5 if cfg.unet_gate == "sigmoid" else 1.0)


def skip_weight_index(cfg: ModelConfig) -> list[int | None]:
    """Per layer, the index of its skip's weight (None: no skip): decoder layer i has weight
    i − (L − L//2), an explicit skip its position in `model.skips`."""
    L, sources = cfg.n_layer, skip_sources(cfg)
    if cfg.skips:
        order = {dst: j for j, (_, dst) in enumerate(explicit_skips(cfg.skips))}
        return [order.get(i) for i in range(L)]
    return [i - (L - L // 2) if sources[i] is not None else None for i in range(L)]


def skip_scale(weight: torch.Tensor, gate: str) -> torch.Tensor:
    """The factor of a skip: the weight itself, or sigmoid(weight) (#32)."""
    return torch.sigmoid(weight) if gate == "sigmoid" else weight
