"""The attention part of a gpt2026 model: its scale, rotary and gates, the layers with #49's key offset,
#58's paired heads and #82's XSA, and the sliding windows (`[model.attn]`). Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from speedrun.config.types import PosInt
from speedrun.errors import ConfigError


@dataclass(frozen=True)
class AttnConfig:
    scale: float = 0.1  # the logit scale before YaRN
    qk_head_dim: int = 0  # #344: Q/K width per head (96; V keeps n_embd/n_head); 0 = the same as V
    rope_precision: Literal["auto", "fp32", "bf16", "bf16-angles"] = "auto"  # #32: bf16
    gate: int = 0  # #28: input dims of the per-head output gate (12); 0 none
    fp8_qkv: bool = False  # #344: the packed Q/K/V projection in FP8 in training (model/gpt2026/fp8_qkv.py)
    key_offset_layers: list[int] = field(default_factory=list)  # #49
    paired_layers: list[int] = field(default_factory=list)  # #58
    xsa_layers: list[int] = field(default_factory=list)  # #82: gated XSA (unpaired attention layers)
    yarn: bool = False  # #31
    # model.attention = auto/sdpa/flex: document-masked attention with a tensor window (#26's sliding
    # window); varlen takes fixed token windows
    window: int = 0
    window_granularity: Literal["token", "block"] = "token"
    window_warmup: Literal["none", "floor", "ceil"] = "none"
    window_warmup_start: int = 64
    window_unit: PosInt = 128

    #: the flat `model.*` names of the fields before the parts (old config.json files and recipes); None:
    #: a field added after them, which has none
    FLAT: ClassVar[dict[str, str | None]] = {"scale": "attn_scale", "gate": "attn_gate", "fp8_qkv": None}


def check(a: AttnConfig, m: Any) -> None:
    """Layer lists in range and among the attention layers; the rotary's and the gate's widths."""
    L = m.n_layer
    for key in ("key_offset_layers", "paired_layers", "xsa_layers"):
        layers = getattr(a, key)
        if any(not 0 <= i < L for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"model.attn.{key} {list(layers)}: distinct layers 0..{L - 1}")
    if not set(a.key_offset_layers) <= set(m.attention_layers):
        raise ConfigError("model.attn.key_offset_layers must be attention layers")
    if a.paired_layers and not set(a.paired_layers) <= set(m.attention_layers) - set(a.key_offset_layers):
        raise ConfigError(
            f"model.attn.paired_layers {list(a.paired_layers)} must name layers with attention and without "
            "#49's key offset"
        )
    if not set(a.xsa_layers) <= set(m.attention_layers) - set(a.paired_layers):
        raise ConfigError(
            f"model.attn.xsa_layers {list(a.xsa_layers)} (#82) must be attention layers without paired heads"
        )
    if a.paired_layers and (m.n_head % 2 or a.window_granularity != "token"):
        raise ConfigError("model.attn.paired_layers needs an even model.n_head and token windows")
    if (m.n_embd // m.n_head) % 4:
        raise ConfigError("the gpt2026 rotary (half-truncated) needs a head dimension divisible by 4")
    if a.qk_head_dim < 0 or a.qk_head_dim % 4:
        raise ConfigError(
            f"model.attn.qk_head_dim (#344) is 0 (Q/K as wide as V) or a positive multiple of 4 (the "
            f"rotary), got {a.qk_head_dim}"
        )
    if a.gate > m.n_embd:
        raise ConfigError(f"model.attn.gate ({a.gate}) must not exceed model.n_embd ({m.n_embd}) input dims")
    if a.window < 0 or a.window_warmup != "none" and a.window <= 0:
        raise ConfigError("model.attn.window must be >= 0, and > 0 with model.attn.window_warmup")


def qk_width(m: Any) -> int:
    """Q/K dims per head: #344's model.attn.qk_head_dim, else the V width n_embd / n_head."""
    return m.attn.qk_head_dim or m.n_embd // m.n_head


def attention_scale(m: Any) -> float:
    """The attention logit scale before YaRN: model.attn.scale, times √(V width / Q/K width) with #344's
    narrower Q/K (0.1·√(128/96)), which keeps the logits' size as the dot products get fewer terms."""
    return m.attn.scale * math.sqrt(m.n_embd // m.n_head / qk_width(m))  # (× 1.0 exactly when as wide)
