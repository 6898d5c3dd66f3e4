"""Which layer of a gpt2024 model has what: pure functions of its config."""

from __future__ import annotations

from speedrun.config import ModelConfig


def attention_layers(cfg: ModelConfig) -> list[bool]:
    """Per layer, whether it has attention (Sub3Min drops it in layer 7)."""
    dropped = {int(s) for s in cfg.no_attention_layers.split(",") if s.strip()}
    return [i not in dropped for i in range(cfg.n_layer)]


def value_embed_layout(cfg: ModelConfig) -> list[int | None]:
    """Per layer, the value-embedding table it mixes into v (None: none): per-layer (12-04) table i; unet
    (12-08) L/2 tables, decoder layer i uses L/2-1-i; ends (Sub3Min) k tables on the first and last k layers,
    e.g. [0, 1, 2, None × 6, 0, 1, 2]."""
    L = cfg.n_layer
    if cfg.value_embeds == "per-layer":
        return list(range(L))
    if cfg.value_embeds == "unet":
        half = list(range(L // 2))
        return half + half[::-1]
    if cfg.value_embeds == "ends":
        k = cfg.value_embed_tables
        return list(range(k)) + [None] * (L - 2 * k) + list(range(k))
    return [None] * L
