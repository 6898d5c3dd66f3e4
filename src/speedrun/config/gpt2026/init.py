"""How the blocks' matrices and the value embeddings start (`[model.init]`). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from speedrun.errors import ConfigError


@dataclass(frozen=True)
class InitConfig:
    qkv_gain: float = 0.5  # #53: Q/K/V uniform with std gain/√d (1.0); the MLP keeps 0.5
    value_embed_zero: bool = False  # #49 on: value embeddings start at zero (before: N(0, 1))
    value_embed_std: float = 0.0  # #70: value embeddings from N(0, std²) (0.01); 0 = as above
    attn_out_gain: float = 0.0  # #82 (vo_bank uniform): O with std gain/√d like V (0.5); 0 = zero init
    mimetic_vo_beta: float = 0.0  # #64: V ≈ √β·I, O ≈ −√β·I (0.05); 0 = Q/K/V uniform, O zero

    FLAT: ClassVar[dict[str, str]] = {
        "qkv_gain": "qkv_init_gain",
        "value_embed_zero": "value_embed_zero_init",
        "value_embed_std": "value_embed_init_std",
        "attn_out_gain": "attn_out_init_gain",
    }


def check(p: InitConfig, m: Any) -> None:
    if p.attn_out_gain and p.mimetic_vo_beta:
        raise ConfigError("model.init.attn_out_gain is not combined with model.init.mimetic_vo_beta")
    if p.mimetic_vo_beta > 1:
        raise ConfigError(f"model.init.mimetic_vo_beta (#64) must be 0..1 (0 = off), got {p.mimetic_vo_beta}")
    if p.value_embed_std and (p.value_embed_zero or max(m.value_embeds, default=-1) < 0):
        raise ConfigError(
            "model.init.value_embed_std (#70) needs value embeddings and model.init.value_embed_zero=false"
        )
