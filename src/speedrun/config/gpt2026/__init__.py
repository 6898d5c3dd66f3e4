"""The gpt2026 family's model config (records #26 on): shape, per-layer lists, and one small config per
part (`[model.attn]`, `[model.mudd]`, ... each in its own module here, with its own check).

What every 2025–26 record has is not a field (half-truncated rotary, RMSNorm, QK-norm, ReLU², no
biases, fused QKV, untied head, x0, document masks, scaled-uniform init). What differs by layer is a
typed list read once by model/gpt2026/specs.py; an unused technique is an empty list or a 0, and the
model has no part for it. Torch-free. The rules here are the ones *between* parts; `FLAT` maps the flat
keys of the config before the parts (`model.mudd_sources`) to their tables (`model.mudd.sources`), and
`from_model_config` converts the gpt2024 switches (config.json of a 2025 run written before the split)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Annotated, Any, Literal

from speedrun.config.gpt2026 import attn, embed, head, init, mlp, mudd, ngram, stream, values
from speedrun.config.gpt2026.attn import AttnConfig, attention_scale, layer_scale, qk_width  # noqa: F401
from speedrun.config.gpt2026.embed import EmbedConfig
from speedrun.config.gpt2026.head import HeadConfig
from speedrun.config.gpt2026.init import InitConfig
from speedrun.config.gpt2026.mlp import MlpConfig
from speedrun.config.gpt2026.mudd import MuddConfig
from speedrun.config.gpt2026.ngram import NgramConfig
from speedrun.config.gpt2026.stream import StreamConfig
from speedrun.config.gpt2026.values import ValuesConfig
from speedrun.config.types import PosInt, Range, SeqLen
from speedrun.errors import ConfigError

TableIndex = Annotated[int, Range(-1)]  # a value-embedding table or a layer (#77), -1 none

#: the part tables: field name of Gpt2026Config → the part's module (its config class and `check`)
PARTS = {
    "attn": attn, "values": values, "stream": stream, "mudd": mudd, "embed": embed, "mlp": mlp,
    "head": head, "init": init, "ngram": ngram,
}  # fmt: skip


@dataclass
class Gpt2026Config:
    """Shape, per-layer lists and the part tables of the gpt2026 family."""

    family: Literal["gpt2024", "gpt2026"] = "gpt2026"  # config.MODEL_FAMILIES
    vocab_size: PosInt = 50257
    pad_vocab_to: PosInt = 128
    n_layer: PosInt = 12
    n_head: PosInt = 6
    n_embd: PosInt = 768
    mlp_ratio: PosInt = 4
    max_seq_len: SeqLen = 262144
    eot_id: int = 50256
    # #57: attention and MLP matrices stored in bf16, stepped in fp32 through NorMuon's mantissa buffer
    block_dtype: Literal["fp32", "bf16"] = "fp32"
    # varlen: packed documents with cu_seqlens (#29 on); auto/sdpa/flex: document-masked attention with a
    # tensor window (model.attn.window*)
    attention: Literal["auto", "sdpa", "flex", "varlen"] = "varlen"
    # --- per layer (n_layer entries, or layer indices) ---
    attention_layers: list[int] = field(default_factory=list)  # layers with attention (#35: not 0)
    mlp_layers: list[int] = field(default_factory=list)  # layers with an MLP (#30: not 0)
    windows: list[str] = field(default_factory=list)  # per layer "L" (long) or "S" (short)
    value_embeds: list[TableIndex] = field(default_factory=list)  # per layer its table, -1 none
    skips: list[list[int]] = field(default_factory=list)  # [src, dst] pairs, one weight each (#45)
    # #77: per layer the earlier layer whose output its attention reads (-1: its own stream); empty: every
    # layer reads its own
    attn_inputs: list[TableIndex] = field(default_factory=list)
    # --- the parts ---
    attn: AttnConfig = field(default_factory=AttnConfig)
    values: ValuesConfig = field(default_factory=ValuesConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    mudd: MuddConfig = field(default_factory=MuddConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    mlp: MlpConfig = field(default_factory=MlpConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    init: InitConfig = field(default_factory=InitConfig)
    ngram: NgramConfig = field(default_factory=NgramConfig)  # #92's hashed n-gram table


#: old flat key (without `model.`) → (part, field), `model.mudd_sources` → ("mudd", "sources"), from each
#: part's fields and its `FLAT` renames (a field mapped to None came after the parts: no old file names it);
#: the one converter of flat keys (config_files applies it)
FLAT: dict[str, tuple[str, str]] = {
    name: (part.name, f.name)
    for part in fields(Gpt2026Config)
    if part.name in PARTS
    for f in fields(part.default_factory)
    if (name := part.default_factory.FLAT.get(f.name, f.name))
}
Gpt2026Config.FLAT_KEYS = FLAT  # what config.canonical_key reads of any family's config class


def check(m: Gpt2026Config) -> None:
    """Each part's own check, then the rules between parts: per-layer lists of n_layer entries, layer
    indices in range, and what a part needs of the others."""
    L = m.n_layer
    if not m.attention_layers and not m.mlp_layers:
        raise ConfigError(
            "model.attention_layers and model.mlp_layers list the layers that have them: both empty"
        )
    for key in ("windows", "value_embeds"):
        if getattr(m, key) and len(getattr(m, key)) != L:
            raise ConfigError(f"model.{key} must have one entry per layer ({L}), got {len(getattr(m, key))}")
    tables = {j for j in m.value_embeds if j >= 0}
    if tables != set(range(len(tables))):
        raise ConfigError(f"model.value_embeds {m.value_embeds}: tables are numbered 0..n-1, -1 for none")
    if any(w not in ("L", "S") for w in m.windows):
        raise ConfigError(f"model.windows: every entry is L (long) or S (short), got {m.windows}")
    for key in ("attention_layers", "mlp_layers"):
        layers = getattr(m, key)
        if any(not 0 <= i < L for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"model.{key} {layers}: distinct layers 0..{L - 1}")
    if any(len(p) != 2 or not 0 <= p[0] < p[1] < L for p in m.skips) or len({p[1] for p in m.skips}) < len(
        m.skips
    ):
        raise ConfigError(f"model.skips {m.skips}: [src, dst] pairs, 0 <= src < dst < {L}, one per dst")
    # present: attention, an MLP or (#92) an injection site
    present = (
        set(m.attention_layers) | set(m.mlp_layers) | set(m.stream.x0_layers) | set(m.stream.bigram_layers)
    )
    if m.attn_inputs and (
        len(m.attn_inputs) != L
        or any(j != -1 and not (0 <= j < i and j in present and i in m.attention_layers)
               for i, j in enumerate(m.attn_inputs))
    ):  # fmt: skip
        raise ConfigError(
            f"model.attn_inputs {m.attn_inputs} (#77): one entry per layer ({L}), -1 or (on an attention "
            "layer) an earlier present layer"
        )
    for name, module in PARTS.items():
        module.check(getattr(m, name), m)
    if m.embed.bigram_in_x0 and not (m.embed.bigram_rows and m.stream.residual_form == "sublayer"):
        raise ConfigError(
            "model.embed.bigram_in_x0 needs model.embed.bigram_rows and "
            "model.stream.residual_form = 'sublayer'"
        )
    if "S" in m.windows and m.attention != "varlen" and m.attn.window <= 0:
        raise ConfigError(
            "model.windows with short (S) layers needs model.attn.window > 0 or attention=varlen"
        )


def _layers(text: str) -> set[int]:
    return {int(s) for s in text.split(",") if s.strip()}


#: what every 2025 recipe's gpt2024 model has (and gpt2026 fixes): a config.json without `family` whose
#: model has all of these and whose data come from the document loader (#26 on) is a gpt2026 model; what
#: shared code reads of them comes from here too (config/families.py, gpt2026's facts)
FIXED_2025 = {
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
    fixed = all(model.get(k, v) == v for k, v in FIXED_2025.items())
    if not fixed or model.get("value_embeds") in (None, "none"):
        return None
    try:
        return from_model_config(SimpleNamespace(**model))
    except (AttributeError, KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"model: a pre-split 2025 model section that cannot be converted ({e})") from None


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


#: the gpt2024 switches a 2025 recipe's gpt2026 model keeps as they are, under their flat names (`FLAT`)
_KEPT_2025 = (
    "vocab_size", "pad_vocab_to", "n_layer", "n_head", "n_embd", "mlp_ratio", "max_seq_len", "eot_id",
    "pad_embeddings", "embed_dtype", "attention", "window", "window_granularity", "window_warmup",
    "window_warmup_start", "window_unit", "attn_scale", "yarn", "rope_precision", "attn_gate", "ve_gate",
    "skip_gate", "resid_lambda_init", "x0_lambda_apart", "backout_layer", "smear", "bigram_rows",
    "mlp_fc_transposed", "logit_softcap", "softcap_divisor", "softcap_offset", "softcap_in_bf16", "ce_bf16",
    "fp8_head", "zero_init_head", "head_init_std", "mtp",
)  # fmt: skip


def from_model_config(m: SimpleNamespace) -> dict[str, Any]:
    """A 2025 recipe's pre-split model section (gpt2024 switches, read as attributes) → the same model
    as a gpt2026 `model` table, its part fields by their flat names (`FLAT`). Assumes what every 2025
    recipe has (`legacy_model_table` checks it first)."""
    L = m.n_layer
    no_attn, no_mlp = _layers(m.no_attention_layers), _layers(m.no_mlp_layers)
    attn = [i for i in range(L) if i not in no_attn]
    mlp = [i for i in range(L) if i not in no_mlp]
    windows = list(m.window_pattern or "L" * L)
    if m.skips:
        skips = [[int(a), int(b)] for a, b in (p.split(">") for p in m.skips.split(",") if p.strip())]
    else:  # U-Net: weight j feeds decoder layer L - L//2 + j from encoder layer L//2 - 1 - j
        skips = [[L - 1 - dst, dst] for dst in range(L - L // 2, L)]
    return dict(
        family="gpt2026",
        **{k: getattr(m, k) for k in _KEPT_2025},
        attention_layers=attn,
        mlp_layers=mlp,
        windows=windows,
        value_embeds=_value_embed_layout(m.value_embeds, m.value_embed_tables, L),
        skips=skips,
        key_offset_layers=[i for i in attn if m.key_offset and windows[i] == "L"],
        paired_layers=sorted(_layers(m.paired_heads)),
        value_mix="weights" if m.value_mix == "weights" else "lambdas",
        skip_gate_form=m.unet_gate,
    )
