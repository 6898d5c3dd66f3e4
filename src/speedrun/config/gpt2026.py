"""The gpt2026 family's model config (records #26 on): a fixed block, and per-layer lists.

What every 2025–26 record has is not a field (half-truncated rotary, RMSNorm, QK-norm, ReLU², no
biases, fused QKV, untied head, x0, document masks, scaled-uniform init). What differs by layer is a
typed list read once by model/gpt2026/specs.py; an unused technique is an empty list or a 0, and the
model has no part for it. Torch-free. `from_model_config` is the one converter from the gpt2024
switches (config.json of a 2025 run written before the split)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from speedrun.config.types import PosInt, Range, SeqLen
from speedrun.errors import ConfigError

TableIndex = Annotated[int, Range(-1)]  # a value-embedding table or a layer (#77), -1 none


@dataclass
class Gpt2026Config:
    """Shape, per-layer lists and the few whole-model numbers of the gpt2026 family."""

    family: Literal["gpt2024", "gpt2026"] = "gpt2026"  # config.MODEL_FAMILIES
    vocab_size: PosInt = 50257
    pad_vocab_to: PosInt = 128
    n_layer: PosInt = 12
    n_head: PosInt = 6
    n_embd: PosInt = 768
    mlp_ratio: PosInt = 4
    max_seq_len: SeqLen = 262144
    eot_id: int = 50256
    pad_embeddings: bool = True  # token/value embedding rows padded like the head
    embed_dtype: Literal["fp32", "bf16"] = "bf16"
    # --- per layer (n_layer entries, or layer indices) ---
    attention_layers: list[int] = field(default_factory=list)  # layers with attention (#35: not 0)
    mlp_layers: list[int] = field(default_factory=list)  # layers with an MLP (#30: not 0)
    windows: list[str] = field(default_factory=list)  # per layer "L" (long) or "S" (short)
    value_embeds: list[TableIndex] = field(
        default_factory=list
    )  # per layer its value-embedding table, -1 none
    skips: list[list[int]] = field(default_factory=list)  # [src, dst] pairs, one weight each (#45)
    key_offset_layers: list[int] = field(default_factory=list)  # #49
    paired_layers: list[int] = field(default_factory=list)  # #58
    xsa_layers: list[int] = field(default_factory=list)  # #82: gated XSA (unpaired attention layers)
    # --- attention ---
    # varlen: packed documents with cu_seqlens (#29 on); auto/sdpa/flex: document-masked attention
    # with a tensor window (#26's sliding window, model.window*)
    attention: Literal["auto", "sdpa", "flex", "varlen"] = "varlen"
    window: int = 0
    window_granularity: Literal["token", "block"] = "token"
    window_warmup: Literal["none", "floor", "ceil"] = "none"
    window_warmup_start: int = 64
    window_unit: PosInt = 128
    attn_scale: float = 0.1
    qk_head_dim: int = 0  # #344: Q/K width per head (96; V keeps n_embd/n_head); 0 = the same as V
    yarn: bool = False  # #31
    rope_precision: Literal["auto", "fp32", "bf16", "bf16-angles"] = "auto"  # #32: bf16
    attn_gate: int = 0  # #28: input dims of the per-head output gate (12); 0 none
    ve_gate: int = 0  # #55
    ve_gate_ve_dims: int = 0  # #70: the gate reads x[:ve_gate − n] and the embedding's first n dims (6)
    ve_gate_paired_ve_dims: bool = False  # #89's script: paired layers' gates read them too (#70: x[:12])
    value_mix: Literal["lambdas", "weights"] = "lambdas"  # #47/#48: weights
    # --- connections ---
    skip_gate_form: Literal["weight", "sigmoid"] = "weight"  # #32: sigmoid
    skip_gate: int = 0  # #55
    resid_lambda_init: float = 1.0  # #45: 1.1
    # #89's script adds layer 0's bigram share to x0 itself (in place, on the tensor x and x0 share): every
    # later x0 term and the skip gate read it; #82 adds it to x only
    bigram_in_x0: bool = False
    x0_lambda_apart: bool = False  # #52
    # medium-2025-12 (#124's second embedding): a second token embedding, normed, added to every layer's
    # input with its own x0 weight (needs x0_lambda_apart: the two weights are one "x0" pair per layer)
    embed2: bool = False
    backout_layer: int = 0  # #40; 0 none
    attn_inputs: list[TableIndex] = field(
        default_factory=list
    )  # #77: per layer the earlier layer whose output
    # its attention reads (-1: its own stream); empty: every layer reads its own
    # #77 (SimplifyHC): "sublayer" = x ← r_a·x + p_a·attn + x0·λ_x0 + bigram·λ_b, x ← r_m·x + p_m·mlp, the
    # first layer's bigram share added before it, λ_x0 its own weight (label x0); "x0-first" = x ← λ0·x +
    # λ1·x0 + bigram, then x += attn, mlp
    residual_form: Literal["x0-first", "sublayer"] = "x0-first"
    mudd_sources: list[int] = field(default_factory=list)  # #81: [h, s] (record [7, 3]); empty: no MUDD
    mudd_gate_layer: int = 0  # #85: the gate network's post MLP reads this layer's input (record 4); 0 none
    mudd_gate_attn_layers: list[int] = field(
        default_factory=list
    )  # #85: its attention gates (record [3, 10])
    dc_layers: list[int] = field(default_factory=list)  # #85: DC correction, weights from the gate ([10])
    # --- embeddings, MLP, head ---
    smear: int = 0  # #34: input dims of the smear gate (12); 0 none
    bigram_rows: int = 0  # #62
    bigram_sign_rows: int = 0  # #83: rows of the ±1 sign table (8192); 0 none
    bigram_dim: int = (
        0  # #89's script: the bigram rows are this wide, added to the stream's first dims (192); 0 = n_embd
    )
    mlp_fc_transposed: bool = False  # #27
    mlp_fp8: bool = False  # #84/#89: FP8 MLP forward in training (refresh_fp8 after each optimizer step)
    logit_softcap: float = 15.0
    softcap_divisor: float = 0.0
    softcap_offset: float = 0.0  # #54
    softcap_in_bf16: bool = False
    ce_bf16: bool = False  # #37
    fp8_head: bool = True
    # #57: attention and MLP matrices stored in bf16, stepped in fp32 through NorMuon's mantissa buffer
    block_dtype: Literal["fp32", "bf16"] = "fp32"
    # --- init ---
    qkv_init_gain: float = 0.5  # #53: Q/K/V uniform with std gain/√d (1.0); the MLP keeps 0.5
    value_embed_zero_init: bool = False  # #49 on: value embeddings start at zero (before: N(0, 1))
    value_embed_init_std: float = 0.0  # #70: value embeddings from N(0, std²) (0.01); 0 = as above
    attn_out_init_gain: float = 0.0  # #82 (vo_bank uniform): O with std gain/√d like V (0.5); 0 = zero init
    mimetic_vo_beta: float = 0.0  # #64: V ≈ √β·I, O ≈ −√β·I (0.05); 0 = Q/K/V uniform, O zero
    zero_init_head: bool = True
    head_init_std: float = 0.0  # #51/#53
    mtp: int = 0  # #53
    canonical_val_mask: bool = False  # #350: validation drops pairs GPT-2 never emits (a 316 MB buffer)
    prefix_loss_weight: float = 0.0  # #88: weight of the prefix-token loss in training (0.25); 0 none

    # what shared code reads of any family's config (the 2024 switches this family does not have)
    tie_embeddings = False
    fused_qkv = True
    bf16_model = False
    logits_vocab_only = False
    positional = "rotary"
    softcap_form = "sigmoid"
    sdpa_kernel = "auto"
    rope_half_truncated = True
    document_mask = True
    window_block_list = False

    @property
    def window_pattern(self) -> str:
        return "".join(self.windows)


def check(m: Gpt2026Config) -> None:
    """The family's own rules: per-layer lists of n_layer entries, layer indices in range, and what a
    part needs of the others. A fixed composition has no switch combinations to refuse."""
    L = m.n_layer
    if not m.attention_layers and not m.mlp_layers:
        raise ConfigError(
            "model.attention_layers and model.mlp_layers list the layers that have them: both empty"
        )
    if m.mlp_fp8 and m.mlp_fc_transposed:
        raise ConfigError(
            "model.mlp_fp8 (#84/#89) keeps the up-projection (hidden, dim): drop model.mlp_fc_transposed"
        )
    if m.canonical_val_mask and m.logit_softcap <= 0:
        raise ConfigError(
            "model.canonical_val_mask (#350) needs model.logit_softcap > 0 (-60 lies below capped logits)"
        )
    if m.prefix_loss_weight < 0:
        raise ConfigError(f"model.prefix_loss_weight (#88) is >= 0, got {m.prefix_loss_weight}")
    if m.bigram_sign_rows < 0 or (m.bigram_sign_rows and not m.bigram_rows):
        raise ConfigError("model.bigram_sign_rows (#83) needs model.bigram_rows and is >= 0")
    if m.bigram_dim and not (m.bigram_rows and 0 < m.bigram_dim <= m.n_embd):
        raise ConfigError(f"model.bigram_dim {m.bigram_dim} needs model.bigram_rows and is 1..model.n_embd")
    if m.residual_form == "sublayer" and m.x0_lambda_apart:
        raise ConfigError("model.residual_form = 'sublayer' has its own x0 lambdas: drop x0_lambda_apart")
    if m.attn_out_init_gain < 0 or (m.attn_out_init_gain and m.mimetic_vo_beta):
        raise ConfigError(
            "model.attn_out_init_gain must be >= 0 and is not combined with model.mimetic_vo_beta"
        )
    if m.bigram_in_x0 and not (m.bigram_rows and m.residual_form == "sublayer"):
        raise ConfigError("model.bigram_in_x0 needs model.bigram_rows and model.residual_form = 'sublayer'")
    if m.ve_gate_paired_ve_dims and not m.ve_gate_ve_dims:
        raise ConfigError("model.ve_gate_paired_ve_dims needs model.ve_gate_ve_dims")
    for key in ("windows", "value_embeds"):
        if getattr(m, key) and len(getattr(m, key)) != L:
            raise ConfigError(f"model.{key} must have one entry per layer ({L}), got {len(getattr(m, key))}")
    tables = {j for j in m.value_embeds if j >= 0}
    if tables != set(range(len(tables))):
        raise ConfigError(f"model.value_embeds {m.value_embeds}: tables are numbered 0..n-1, -1 for none")
    if any(w not in ("L", "S") for w in m.windows):
        raise ConfigError(f"model.windows: every entry is L (long) or S (short), got {m.windows}")
    for key in ("attention_layers", "mlp_layers", "key_offset_layers", "paired_layers", "xsa_layers"):
        layers = getattr(m, key)
        if any(not 0 <= i < L for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"model.{key} {layers}: distinct layers 0..{L - 1}")
    if not set(m.key_offset_layers) <= set(m.attention_layers):
        raise ConfigError("model.key_offset_layers must be attention layers")
    if m.paired_layers and not set(m.paired_layers) <= set(m.attention_layers) - set(m.key_offset_layers):
        raise ConfigError(
            f"model.paired_layers {m.paired_layers} must name layers with attention and without #49's "
            "key offset"
        )
    if not set(m.xsa_layers) <= set(m.attention_layers) - set(m.paired_layers):
        raise ConfigError(
            f"model.xsa_layers {m.xsa_layers} (#82) must be attention layers without paired heads"
        )
    if m.paired_layers and (m.n_head % 2 or m.window_granularity != "token"):
        raise ConfigError("model.paired_layers needs an even model.n_head and token windows")
    if any(len(p) != 2 or not 0 <= p[0] < p[1] < L for p in m.skips) or len({p[1] for p in m.skips}) < len(
        m.skips
    ):
        raise ConfigError(f"model.skips {m.skips}: [src, dst] pairs, 0 <= src < dst < {L}, one per dst")
    if (m.n_embd // m.n_head) % 4:
        raise ConfigError("the gpt2026 rotary (half-truncated) needs a head dimension divisible by 4")
    if m.qk_head_dim < 0 or m.qk_head_dim % 4:
        raise ConfigError(
            f"model.qk_head_dim (#344) is 0 (Q/K as wide as V) or a positive multiple of 4 (the rotary), "
            f"got {m.qk_head_dim}"
        )
    for key in ("attn_gate", "smear"):
        if getattr(m, key) > m.n_embd:
            raise ConfigError(
                f"model.{key} ({getattr(m, key)}) must not exceed model.n_embd ({m.n_embd}) input dims"
            )
    for key, needs, ok in (
        ("ve_gate", "model.value_embeds", max(m.value_embeds, default=-1) >= 0),
        ("skip_gate", "model.skips", bool(m.skips)),
    ):
        if getattr(m, key) > m.n_embd or (getattr(m, key) and not ok):  # #55
            raise ConfigError(f"model.{key} (#55) must be 0..model.n_embd input dims and needs {needs}")
    if m.embed2 and (not m.x0_lambda_apart or m.residual_form != "x0-first"):
        raise ConfigError("model.embed2 needs model.x0_lambda_apart=true (its weight joins the x0 pair)")
    if m.ve_gate_ve_dims and not 0 < m.ve_gate_ve_dims < m.ve_gate:
        raise ConfigError(
            f"model.ve_gate_ve_dims (#70) must be 1..model.ve_gate - 1, got {m.ve_gate_ve_dims}"
        )
    if m.value_embed_init_std and (m.value_embed_zero_init or max(m.value_embeds, default=-1) < 0):
        raise ConfigError(
            "model.value_embed_init_std (#70) needs value embeddings and value_embed_zero_init=false"
        )
    if not 0 <= m.mimetic_vo_beta <= 1:
        raise ConfigError(f"model.mimetic_vo_beta (#64) must be 0..1 (0 = off), got {m.mimetic_vo_beta}")
    if m.bigram_rows and not 2 <= m.bigram_rows <= 2**31:
        raise ConfigError("model.bigram_rows (#62) must be 2..2^31 hash buckets")
    if not 0 <= m.backout_layer < L:
        raise ConfigError(f"model.backout_layer ({m.backout_layer}) must be below model.n_layer ({L})")
    if m.attn_inputs and (
        len(m.attn_inputs) != L
        or any(j != -1 and not (0 <= j < i and j in set(m.attention_layers) | set(m.mlp_layers)
                                and i in m.attention_layers) for i, j in enumerate(m.attn_inputs))
    ):  # fmt: skip
        raise ConfigError(
            f"model.attn_inputs {m.attn_inputs} (#77): one entry per layer ({L}), -1 or (on an attention "
            "layer) an earlier present layer"
        )
    if m.mudd_sources:
        _check_mudd(m)
    if m.mudd_gate_layer or m.mudd_gate_attn_layers or m.dc_layers:
        _check_mudd_gate(m)
    if m.window < 0 or m.window_warmup != "none" and m.window <= 0:
        raise ConfigError("model.window must be >= 0, and > 0 with model.window_warmup")
    if "S" in m.windows and m.attention != "varlen" and m.window <= 0:
        raise ConfigError("model.windows with short (S) layers needs model.window > 0 or attention=varlen")
    if m.head_init_std < 0 or (m.head_init_std > 0 and m.zero_init_head):
        raise ConfigError("model.head_init_std must be >= 0, and > 0 only with model.zero_init_head=false")
    if m.softcap_offset and m.logit_softcap <= 0:
        raise ConfigError("model.softcap_offset needs model.logit_softcap > 0")


def _check_mudd(m: Gpt2026Config) -> None:
    """#81's MUDD reads the composition the record gives it: one line naming what is missing."""
    L, last = m.n_layer, m.n_layer - 1
    present = set(m.attention_layers) | set(m.mlp_layers)
    h, s = (m.mudd_sources + [-1, -1])[:2]
    tables = m.value_embeds or [-1] * L
    needs = (
        (len(m.mudd_sources) == 2 and h != s and {h, s} <= present and max(h, s) < L - 2,
         f"[h, s]: two distinct present layers below {L - 2} (record [7, 3]), got {m.mudd_sources}"),
        (m.residual_form == "sublayer", "model.residual_form='sublayer' (#77's residual form)"),
        (last in m.attention_layers and last in m.mlp_layers and last - 1 in present
         and last not in m.paired_layers, "an unpaired attention and an MLP on the last layer, one before"),
        (tables[last] >= 0 and 0 in tables, "a value embedding on the last layer, and table 0"),
        (m.value_mix == "weights", "model.value_mix='weights' (v + the mix, #47/#48)"),
        (m.n_head % 2 == 0, "an even model.n_head (its value-embedding gate has one lane per half)"),
        (not m.backout_layer, "model.backout_layer=0 (#81 folds the backout into a MUDD bias)"),
    )  # fmt: skip
    for ok, what in needs:
        if not ok:
            raise ConfigError(f"model.mudd_sources (#81) needs {what}")


def _check_mudd_gate(m: Gpt2026Config) -> None:
    """#85's gate network replaces the static gates it generates: one line naming what is missing."""
    g, L = m.mudd_gate_layer, m.n_layer
    present = set(m.attention_layers) | set(m.mlp_layers)
    attn = m.mudd_gate_attn_layers
    needs = (
        (bool(m.mudd_sources), "model.mudd_sources (#81's MUDD, whose MLP shape it shares)"),
        (0 < g < L - 1 and g in present, f"model.mudd_gate_layer: a present layer 1..{L - 2} (4), got {g}"),
        (set(attn) <= set(m.attention_layers) and len(set(attn)) == len(attn),
         f"model.mudd_gate_attn_layers {attn}: distinct attention layers"),
        (m.attn_gate == 0, "model.attn_gate=0 (it gives the attention gates, #28's are gone)"),
        (m.skip_gate == 0 and len(m.skips) <= 1 and all(dst >= g for _, dst in m.skips)
         and (not m.skips or m.skip_gate_form == "sigmoid"),
         "model.skip_gate=0, at most one skip, into a layer >= mudd_gate_layer, a sigmoid skip_gate_form"),
        (set(m.dc_layers) <= set(m.attention_layers) - set(m.paired_layers)
         and min(m.dc_layers, default=g) >= g and len(set(m.dc_layers)) == len(m.dc_layers),
         f"model.dc_layers {m.dc_layers}: distinct unpaired attention layers >= model.mudd_gate_layer"),
    )  # fmt: skip
    for ok, what in needs:
        if not ok:
            raise ConfigError(f"model.mudd_gate_layer (#85) needs {what}")


def qk_width(m: Gpt2026Config) -> int:
    """Q/K dims per head: #344's model.qk_head_dim, else the V width n_embd / n_head."""
    return m.qk_head_dim or m.n_embd // m.n_head


def attention_scale(m: Gpt2026Config) -> float:
    """The attention logit scale before YaRN: model.attn_scale, times √(V width / Q/K width) with #344's
    narrower Q/K (0.1·√(128/96)), which keeps the logits' size as the dot products get fewer terms."""
    v = m.n_embd // m.n_head
    return m.attn_scale * math.sqrt(v / m.qk_head_dim) if m.qk_head_dim else m.attn_scale


def _layers(text: str) -> set[int]:
    return {int(s) for s in text.split(",") if s.strip()}


#: what every 2025 recipe's gpt2024 model has (and gpt2026 fixes): a config.json without `family` whose
#: model has all of these and whose data come from the document loader (#26 on) is a gpt2026 model
_FIXED_2025 = {
    "positional": "rotary", "norm": "rmsnorm", "activation": "relu2", "bias": False, "fused_qkv": True,
    "qk_norm": True, "embed_norm": True, "tie_embeddings": False, "zero_init_proj": True,
    "init": "scaled-uniform", "softcap_form": "sigmoid", "document_mask": True, "unet": True,
    "x0_shortcut": True, "value_residual": False, "rope_half_truncated": True, "qk_norm_after_rotary": False,
    "bf16_model": False, "logits_vocab_only": False, "norm_eps": 0.0, "norm_fp32": False,
    "attn_residual_scale": False, "window_block_list": False, "sdpa_kernel": "auto", "mlp_ratio": 4,
}  # fmt: skip


#: the 2025–26 switches the gpt2024 ModelConfig had before the families (their defaults: off)
REMOVED_2024 = {
    "softcap_divisor": 0.0, "softcap_offset": 0.0, "yarn": False, "mlp_fc_transposed": False,
    "attn_gate": 0, "no_mlp_layers": "", "unet_gate": "weight", "smear": 0, "ce_bf16": False,
    "backout_layer": 0, "key_offset": False, "skips": "", "resid_lambda_init": 1.0, "bigram_rows": 0,
    "paired_heads": "", "ve_gate": 0, "skip_gate": 0, "x0_lambda_apart": False, "head_init_std": 0.0,
    "mtp": 0,
}  # fmt: skip


def legacy_gpt2024_table(model: dict) -> dict:
    """A pre-split config.json's gpt2024 `model` section without the 2025–26 switches it wrote at their
    defaults (off); one switched on is not a gpt2024 model any more: refused in one line."""
    for key, default in REMOVED_2024.items():
        if key in model and model[key] != default:
            raise ConfigError(
                f"model.{key}={model[key]!r}: a 2025–26 switch the gpt2024 family no longer has, in a model "
                "that is not a 2025 recipe's gpt2026 model (config.json written before the families)"
            )
    return {k: v for k, v in model.items() if k not in REMOVED_2024}


def legacy_model_table(data: dict) -> dict | None:
    """A config.json (its dict) written before the split, for a 2025 recipe: its `model` section as a
    gpt2026 table (the one converter of old run folders); None when it is a gpt2024 model."""
    model, loader = data.get("model"), (data.get("data") or {}).get("loader")
    if not isinstance(model, dict) or "family" in model or loader != "documents":
        return None
    if any(model.get(k, v) != v for k, v in _FIXED_2025.items()) or model.get("value_embeds") in (
        None,
        "none",
    ):
        return None
    try:
        new = from_model_config(_Fields(model))
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"model: a pre-split 2025 model section that cannot be converted ({e})") from None
    return dataclasses.asdict(new)


class _Fields:
    """A dict read as attributes (from_model_config reads a ModelConfig's)."""

    def __init__(self, d: dict):
        self._d = d

    def __getattr__(self, name: str):
        return self._d[name]


def _value_embed_layout(kind: str, k: int, L: int) -> list[int]:
    """gpt2024's value_embeds names as per-layer tables (model/layout.value_embed_layout), -1 none."""
    layouts = {
        "none": [-1] * L,
        "per-layer": list(range(L)),
        "unet": list(range(L // 2)) + list(range(L // 2))[::-1],
        "ends": list(range(k)) + [-1] * (L - 2 * k) + list(range(k)),
        "ends-late": list(range(1, k)) + [-1] * (L - 2 * k + 1) + list(range(k)),
        "untied-late": list(range(k - 1)) + [-1] * (L - 2 * k + 1) + list(range(k - 1, 2 * k - 1)),
    }
    return layouts[kind]


def from_model_config(m) -> Gpt2026Config:
    """A 2025 recipe's pre-split model section (gpt2024 switches, read as attributes) → the same model
    as a Gpt2026Config. Assumes what every 2025 recipe has (`legacy_model_table` checks it first)."""
    L = m.n_layer
    no_attn, no_mlp = _layers(m.no_attention_layers), _layers(m.no_mlp_layers)
    attn = [i for i in range(L) if i not in no_attn]
    mlp = [i for i in range(L) if i not in no_mlp]
    windows = list(m.window_pattern or "L" * L)
    ve = _value_embed_layout(m.value_embeds, m.value_embed_tables, L)
    if m.skips:
        skips = [[int(a), int(b)] for a, b in (p.split(">") for p in m.skips.split(",") if p.strip())]
    else:  # U-Net: weight j feeds decoder layer L - L//2 + j from encoder layer L//2 - 1 - j
        skips = [[L - 1 - dst, dst] for dst in range(L - L // 2, L)]
    return Gpt2026Config(
        vocab_size=m.vocab_size,
        pad_vocab_to=m.pad_vocab_to,
        n_layer=L,
        n_head=m.n_head,
        n_embd=m.n_embd,
        mlp_ratio=m.mlp_ratio,
        max_seq_len=m.max_seq_len,
        eot_id=m.eot_id,
        pad_embeddings=m.pad_embeddings,
        embed_dtype=m.embed_dtype,
        attention_layers=attn,
        mlp_layers=mlp,
        windows=windows,
        value_embeds=ve,
        skips=skips,
        key_offset_layers=[i for i in attn if m.key_offset and windows[i] == "L"],
        paired_layers=sorted(_layers(m.paired_heads)),
        attention=m.attention,
        window=m.window,
        window_granularity=m.window_granularity,
        window_warmup=m.window_warmup,
        window_warmup_start=m.window_warmup_start,
        window_unit=m.window_unit,
        attn_scale=m.attn_scale,
        yarn=m.yarn,
        rope_precision=m.rope_precision,
        attn_gate=m.attn_gate,
        ve_gate=m.ve_gate,
        value_mix="weights" if m.value_mix == "weights" else "lambdas",
        skip_gate_form=m.unet_gate,
        skip_gate=m.skip_gate,
        resid_lambda_init=m.resid_lambda_init,
        x0_lambda_apart=m.x0_lambda_apart,
        backout_layer=m.backout_layer,
        smear=m.smear,
        bigram_rows=m.bigram_rows,
        mlp_fc_transposed=m.mlp_fc_transposed,
        logit_softcap=m.logit_softcap,
        softcap_divisor=m.softcap_divisor,
        softcap_offset=m.softcap_offset,
        softcap_in_bf16=m.softcap_in_bf16,
        ce_bf16=m.ce_bf16,
        fp8_head=m.fp8_head,
        zero_init_head=m.zero_init_head,
        head_init_std=m.head_init_std,
        mtp=m.mtp,
    )
