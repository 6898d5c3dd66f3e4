"""The families' config-side record, torch-free: what the config layer needs of a family (its own model
checks, and its facts: what shared code reads, which stage features it has, the memory bound's table
count, the gates the optimizer rows see), keyed by `model.family`. model/families.py holds the model side;
a rule that is one family's lives here, never as an `if family ==` elsewhere
(tests/unit/test_import_rules.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from speedrun.config import Config
from speedrun.config.gpt2026 import FIXED_2025, qk_width
from speedrun.config.gpt2026 import check as check_gpt2026_model
from speedrun.config.types import MAX_SEQ_LEN
from speedrun.errors import ConfigError


@dataclass(frozen=True)
class ModelFacts:
    """What shared code (checks, stage plans, schedules, memory bounds, summaries, run data) reads of
    any family's model config, by the gpt2024 switches' names: gpt2024 answers with its fields, gpt2026
    with its parts' or with what it fixes. A family config carries no stand-ins for the other's."""

    tie_embeddings: bool
    fused_qkv: bool
    bf16_model: bool
    logits_vocab_only: bool
    positional: str
    qk_norm: bool
    rope_half_truncated: bool
    rope_precision: str
    attn_scale: float
    document_mask: bool
    window: int  # tokens (0: none)
    window_granularity: str
    window_warmup: str
    window_warmup_start: int
    window_unit: int
    window_block_list: bool
    window_pattern: str  # per layer L or S ("": all long)
    yarn: bool
    embed_dtype: str
    pad_embeddings: bool
    zero_init_head: bool
    logit_softcap: float
    softcap_in_bf16: bool
    fp8_head: bool
    # what the families differ in beyond the gpt2024 switches
    mtp: int  # #53's extra heads (a stage plan reads them with yarn)
    value_tables: int  # value-embedding tables (the fp32 weights' bound)
    # the parts with optimizer rows of their own: (smear, attn_gate, ve_gate, skip_gate, x0_lambda_apart)
    gates: tuple[int, int, int, int, bool]
    qk_head_dim: int  # Q/K dims per head (#344's narrower Q/K; #80's Q/K blocks)
    fp8_mlp: bool  # the MLPs train in FP8 (#84/#89: the memory bound's saved tensors)
    sampled_stride: int  # #92's sampled softmax (a stage plan's sampled= needs it); 0: none
    era: int  # the recipe index's era of a track-1 record: 0 replays 2024-25, 1 is 2026


def _gpt2024_facts(m: Any) -> ModelFacts:
    tables = {"none": 0, "per-layer": m.n_layer, "unet": m.n_layer // 2, "ends": m.value_embed_tables}
    not_switches = dict(
        yarn=False, mtp=0, value_tables=tables[m.value_embeds], gates=(0, 0, 0, 0, False),
        qk_head_dim=m.n_embd // m.n_head, fp8_mlp=False, sampled_stride=0, era=0,
    )  # fmt: skip
    named = {f.name: getattr(m, f.name) for f in fields(ModelFacts) if f.name not in not_switches}
    return ModelFacts(**named, **not_switches)


#: the facts gpt2026 fixes (tie_embeddings=False, fused_qkv=True, ...): the 2025 switches it has no field for
_GPT2026_FIXED = {f.name: FIXED_2025[f.name] for f in fields(ModelFacts) if f.name in FIXED_2025}


def _gpt2026_facts(m: Any) -> ModelFacts:
    a, h, st = m.attn, m.head, m.stream
    return ModelFacts(
        **_GPT2026_FIXED, rope_precision=a.rope_precision, attn_scale=a.scale, window=a.window,
        window_granularity=a.window_granularity, window_warmup=a.window_warmup,
        window_warmup_start=a.window_warmup_start, window_unit=a.window_unit,
        window_pattern="".join(m.windows),
        yarn=a.yarn, embed_dtype=m.embed.dtype, pad_embeddings=m.embed.pad, zero_init_head=h.zero_init,
        logit_softcap=h.softcap, softcap_in_bf16=h.softcap_in_bf16, fp8_head=h.fp8, mtp=h.mtp,
        value_tables=len({j for j in m.value_embeds if j >= 0}),
        gates=(m.embed.smear, a.gate, m.values.gate, st.skip_gate, st.x0_lambda_apart),
        qk_head_dim=qk_width(m), fp8_mlp=m.mlp.fp8, sampled_stride=h.sampled_stride, era=1,
    )  # fmt: skip


@dataclass(frozen=True)
class ConfigFamily:
    """One family's config-side record (`m`: its model config)."""

    check: Callable[[Config], None]  # the family's own model rules, after the shared cross-field ones
    facts: Callable[[Any], ModelFacts]  # what shared code reads of the model config


def _check_gpt2026(cfg: Config) -> None:
    m = cfg.model
    check_gpt2026_model(m)
    gpt2_tables = [k for k in ("prefix_loss_weight", "canonical_val_mask") if getattr(m.head, k)]
    if gpt2_tables and cfg.data.tokenizer != "gpt2":  # #88's and #350's tables are GPT-2 BPE ids
        raise ConfigError(
            f"model.head.{gpt2_tables[0]} reads tables of GPT-2 token ids: it needs data.tokenizer = gpt2, "
            f"got {cfg.data.tokenizer}"
        )


def _check_gpt2024(cfg: Config) -> None:
    """Checks of the gpt2024 family's switches (model/gpt2024/model.py, model/attention.py)."""
    m = cfg.model  # (its numbers are >= 0 and window_unit >= 1 already: config.check_fields ran first)
    if m.window > MAX_SEQ_LEN:  # positions are int32 (config_types.MAX_SEQ_LEN)
        raise ConfigError(f"model.window must be at most {MAX_SEQ_LEN:,} tokens, got {m.window:,}")
    if m.window_warmup != "none" and 0 < m.window < m.window_unit:  # the first window is one unit
        raise ConfigError(
            f"model.window_unit ({m.window_unit}) must not exceed model.window ({m.window}): "
            "the window grows in whole units up to model.window"
        )
    if m.window_warmup == "floor" and 0 < m.window < m.window_warmup_start:
        raise ConfigError(
            f"model.window_warmup_start ({m.window_warmup_start}) must not exceed model.window ({m.window})"
        )
    if m.window_pattern and (len(m.window_pattern) != m.n_layer or set(m.window_pattern) - set("LS")):
        raise ConfigError(
            f"model.window_pattern {m.window_pattern!r} must have one L or S per layer ({m.n_layer} layers)"
        )
    text = m.no_attention_layers  # Sub3Min: attention-free 7
    try:
        layers = {int(s) for s in text.split(",") if s.strip()}
    except ValueError:
        raise ConfigError(
            f"model.no_attention_layers: expected comma-separated layer numbers, got {text!r}"
        ) from None
    if any(not 0 <= i < m.n_layer for i in layers):
        raise ConfigError(f"model.no_attention_layers {text!r}: layers are 0..{m.n_layer - 1}")
    if m.unet and m.n_layer < 2:
        raise ConfigError("model.unet needs at least 2 layers")
    if m.value_embeds == "unet" and m.n_layer % 2:
        raise ConfigError(f"model.value_embeds=unet needs an even model.n_layer, got {m.n_layer}")
    if m.value_embeds == "ends" and not 1 <= m.value_embed_tables <= m.n_layer // 2:
        raise ConfigError(f"model.value_embed_tables must be between 1 and n_layer/2 ({m.n_layer // 2})")
    if m.value_embeds != "none" and m.value_residual:
        raise ConfigError("model.value_residual and model.value_embeds both mix into v; choose one")
    if m.rope_half_truncated and (m.positional != "rotary" or (m.n_embd // m.n_head) % 4):
        raise ConfigError(
            "model.rope_half_truncated needs positional=rotary and a head dimension divisible by 4"
        )
    if m.tie_embeddings and (not m.pad_embeddings or m.embed_dtype != "fp32"):
        raise ConfigError(
            "model.pad_embeddings=false and model.embed_dtype=bf16 need model.tie_embeddings=false"
        )
    if m.cgi_gain_alpha and (m.norm != "rmsnorm-gain" or m.no_attention_layers or m.n_embd % m.n_head):
        raise ConfigError(
            "model.cgi_gain_alpha (#46's CGI gain init) needs model.norm=rmsnorm-gain and attention in "
            "every layer"
        )
    if m.head_bias and (m.tie_embeddings or m.fp8_head):
        raise ConfigError("model.head_bias needs model.tie_embeddings=false and model.fp8_head=false")


FAMILIES: dict[str, ConfigFamily] = {
    "gpt2024": ConfigFamily(_check_gpt2024, _gpt2024_facts),
    "gpt2026": ConfigFamily(_check_gpt2026, _gpt2026_facts),
}


def config_family(m: Any) -> ConfigFamily:
    """The config-side record of model config `m`'s family."""
    return FAMILIES[m.family]


def model_facts(m: Any) -> ModelFacts:
    """What shared code reads of model config `m`, whichever its family."""
    return FAMILIES[m.family].facts(m)
