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
    # #92's mixed widths: these layers' Q/K heads are the rotating half of each full-width head (fully
    # rotating, their own rotary table and scale, YaRN'd by the short window); narrow_v_layers (among
    # them) also halve V and O. The weights stay full width: the unread rows get no gradient.
    narrow_layers: list[int] = field(default_factory=list)
    narrow_v_layers: list[int] = field(default_factory=list)
    narrow_scale: float = 0.13  # #92: the narrow layers' attention scale before YaRN
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
    FLAT: ClassVar[dict[str, str | None]] = {
        "scale": "attn_scale", "gate": "attn_gate", "fp8_qkv": None,
        "narrow_layers": None, "narrow_v_layers": None, "narrow_scale": None,
    }  # fmt: skip


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
    check_narrow(a, m)
    if a.gate > m.n_embd:
        raise ConfigError(f"model.attn.gate ({a.gate}) must not exceed model.n_embd ({m.n_embd}) input dims")
    if a.window < 0 or a.window_warmup != "none" and a.window <= 0:
        raise ConfigError("model.attn.window must be >= 0, and > 0 with model.attn.window_warmup")


def check_narrow(a: AttnConfig, m: Any) -> None:
    """#92's narrow layers: attention layers without #49's key offset (it shifts the stationary dims a
    narrow head no longer has) and without #344's Q/K width; narrow_v_layers among them."""
    if not a.narrow_layers and not a.narrow_v_layers:
        if a.narrow_scale != AttnConfig.narrow_scale:
            raise ConfigError("model.attn.narrow_scale is read only with model.attn.narrow_layers (#92)")
        return
    L = m.n_layer
    for key in ("narrow_layers", "narrow_v_layers"):
        layers = getattr(a, key)
        if any(not 0 <= i < L for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"model.attn.{key} {list(layers)}: distinct layers 0..{L - 1}")
    if not set(a.narrow_layers) <= set(m.attention_layers) - set(a.key_offset_layers):
        raise ConfigError(
            f"model.attn.narrow_layers {list(a.narrow_layers)} (#92) must be attention layers without "
            "#49's key offset (model.attn.key_offset_layers)"
        )
    if not set(a.narrow_v_layers) <= set(a.narrow_layers):
        raise ConfigError(
            f"model.attn.narrow_v_layers {list(a.narrow_v_layers)} (#92) must be among "
            "model.attn.narrow_layers"
        )
    if a.qk_head_dim:
        raise ConfigError(
            "model.attn.narrow_layers (#92) and model.attn.qk_head_dim (#344) exclude each other"
        )
    if (m.n_embd // m.n_head) % 8:
        raise ConfigError("model.attn.narrow_layers (#92) need a head dimension divisible by 8")
    if not a.narrow_scale > 0:
        raise ConfigError(f"model.attn.narrow_scale must be > 0, got {a.narrow_scale}")


def qk_width(m: Any) -> int:
    """Q/K dims per head: #344's model.attn.qk_head_dim, else the V width n_embd / n_head."""
    return m.attn.qk_head_dim or m.n_embd // m.n_head


def layer_scale(m: Any, narrow: bool) -> float:
    """A layer's attention logit scale before YaRN: #92's narrow layers have their own."""
    return m.attn.narrow_scale if narrow else attention_scale(m)


def attention_scale(m: Any) -> float:
    """The attention logit scale before YaRN: model.attn.scale, times √(V width / Q/K width) with #344's
    narrower Q/K (0.1·√(128/96)), which keeps the logits' size as the dot products get fewer terms."""
    return m.attn.scale * math.sqrt(m.n_embd // m.n_head / qk_width(m))  # (× 1.0 exactly when as wide)
