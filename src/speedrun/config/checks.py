"""Cross-field rules of a run configuration, and a memory bound on the model it describes; `validate`
is the one entry (config/__init__.py defines the fields and imports nothing of this, so the layer has no
circle)."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace
from typing import Any

from speedrun.config import Config, ModelConfig, check_fields, sections
from speedrun.config.data import check_source, parse_bpe_size
from speedrun.config.families import config_family, model_facts
from speedrun.config.labels import TABLE_OPTIMIZERS, check_shadowed
from speedrun.config.ships import check as check_ships
from speedrun.config.stages import check_stages
from speedrun.config.subkeys import NEEDS
from speedrun.errors import ConfigError


def validate(cfg: Config) -> None:
    """Every field against its declared type and range first (config.check_fields, so nothing below
    divides by zero or compares with nan), then the rules between fields that do not depend on the
    world size, and last that the stated label rows leave no flat optim field the user gave without effect."""
    check_fields(cfg)
    m, f, t = cfg.model, model_facts(cfg.model), cfg.train
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head})")
    if f.positional == "rotary" and (m.n_embd // m.n_head) % 2:
        raise ConfigError("rotary embeddings need an even head dimension")
    if getattr(m, "block_dtype", "fp32") == "bf16" and cfg.optim.name not in TABLE_OPTIMIZERS:  # #57
        raise ConfigError(
            "model.block_dtype=bf16 needs optim.name=normuon or anvil (their mantissa buffer keeps fp32)"
        )
    for name in ("seq_len", "val_seq_len"):
        if getattr(t, name) > m.max_seq_len:
            raise ConfigError(
                f"train.{name} ({getattr(t, name)}) exceeds model.max_seq_len ({m.max_seq_len})"
            )
    for big, small in (("micro_batch_tokens", "seq_len"), ("global_batch_tokens", "micro_batch_tokens")):
        if getattr(t, big) % getattr(t, small):
            raise ConfigError(
                f"train.{big} ({getattr(t, big)}) must be a multiple of train.{small} ({getattr(t, small)})"
            )
    warmdown = math.ceil(t.warmdown_span())  # the one the schedule uses
    if t.warmup_steps + warmdown > t.steps and t.schedule == "trapezoid":
        raise ConfigError(
            f"train.warmup_steps + the warm-down ({t.warmup_steps + warmdown}) exceed train.steps ({t.steps})"
        )
    if f.tie_embeddings and f.zero_init_head:
        raise ConfigError(
            "model.zero_init_head needs model.tie_embeddings=false (a zero embedding cannot learn)"
        )
    if (f.document_mask or m.attention == "varlen") and m.eot_id >= m.vocab_size:
        raise ConfigError(f"model.eot_id ({m.eot_id}) must be below model.vocab_size ({m.vocab_size})")
    # the source names the data folder (with data.dir it is only a label); gpt2 is the one named tokenizer
    named = [("source", check_source)] * (not cfg.data.dir)
    for name, check in named + [("tokenizer", parse_bpe_size)] * (cfg.data.tokenizer != "gpt2"):
        try:
            check(getattr(cfg.data, name))
        except ConfigError as e:
            raise ConfigError(f"data.{name}: {e}") from None
    documents = cfg.data.loader == "documents"  # it reads a step as global / micro rows (issue 20)
    if documents and t.seq_len != t.micro_batch_tokens:
        raise ConfigError(
            f"data.loader=documents reads one row per micro-batch: train.seq_len ({t.seq_len}) must equal "
            f"train.micro_batch_tokens ({t.micro_batch_tokens})"
        )
    if documents and cfg.data.max_docs == 1:
        raise ConfigError("data.max_docs must be 0 (the records' table) or at least 2")
    check_stages(cfg)
    config_family(m).check(cfg)
    _validate_normuon(cfg)
    check_ships(cfg.optim.ships, cfg)
    given = {"train.warmdown_steps", "train.warmdown_frac"} & cfg.fixed
    if t.warmdown_steps > 0 and t.warmdown_frac > 0 and len(given) == 2:
        raise ConfigError("give train.warmdown_steps or train.warmdown_frac, not both (the share would win)")
    budget_safe = t.schedule == "trapezoid" and not t.stages and f.window_warmup == "none"
    if t.time_budget_s > 0 and not budget_safe:
        raise ConfigError(  # their values at early steps depend on the step count the budget fixes later
            "train.time_budget_s needs train.schedule=trapezoid, no train.stages and model.window_warmup=none"
        )
    check_subkeys(cfg)  # after the rules that say more about a switch than that it is off
    _check_memory(m)
    check_shadowed(cfg.optim, m.n_embd // m.n_head, cfg.fixed)


def _value(cfg: Any, key: str) -> object:
    """A dotted key's value, a part table's field (`model.attn.window`) included."""
    value = cfg
    for name in key.split("."):
        value = getattr(value, name)
    return value


def _alt_on(cfg: Config, alt: str) -> bool:
    """Whether one alternative of a switch (config/subkeys.py's form: "KEY", "KEY=A|B", "!KEY") is on."""
    key, _, values = alt.removeprefix("!").partition("=")
    value = _value(cfg, key)
    blank = isinstance(value, str) and not value.strip()  # a blank train.stages is unset
    return (str(value) in values.split("|") if values else bool(value) and not blank) != alt.startswith("!")


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value.strip() else repr(value)
    return str(list(value) if isinstance(value, tuple) else value)


def check_subkeys(cfg: Config) -> None:
    """A sub-key (config/subkeys.py) away from its default while a switch it needs is off is read by
    nothing: refused, naming both. A default is fine (recipes and config.json state them), and so is a
    recipe's value when the user turned the switch off and left the sub-key alone (one switch takes a part
    out: ablate, a derived recipe file)."""
    for section in sections():
        obj = getattr(cfg, section)
        for name, switches in NEEDS.get(type(obj), {}).items():
            key, value = f"{section}.{name}", _value(cfg, f"{section}.{name}")
            if value == _value(SimpleNamespace(**{section: type(obj)()}), key):
                continue
            for switch in switches:
                alts = switch.split(" or ")
                keys = [alt.removeprefix("!").partition("=")[0] for alt in alts]
                if any(_alt_on(cfg, alt) for alt in alts) or (key not in cfg.fixed and cfg.fixed & set(keys)):
                    continue
                now = ", ".join(f"{k}={_shown(_value(cfg, k))}" for k in keys)
                wanted = " or ".join(
                    f"{a[1:]} off" if a.startswith("!") else a if "=" in a else f"{a} on" for a in alts
                )
                raise ConfigError(
                    f"{key}={_shown(value)} has no effect while {now} (it needs {wanted}); set {keys[0]} or "
                    f"drop {key}"
                )


def _check_memory(m: ModelConfig) -> None:
    """Refuse models whose fp32 weights and position tables (estimated within a few %) cannot fit in
    this machine's memory, where the model is built first: one line naming the key, not an allocator crash."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # a system that does not say: nothing to check against
        return
    f = model_facts(m)
    head_dim, learned = m.n_embd // m.n_head, f.positional == "learned"
    per_position = m.n_embd if learned else m.n_layer * head_dim  # rotary: cos+sin
    positions = 4 * m.max_seq_len * per_position
    if positions > memory:
        whose = "" if learned else f" and model.n_layer={m.n_layer} (a rotary table per layer)"
        raise ConfigError(
            f"model.max_seq_len={m.max_seq_len}{whose} need {positions / 2**30:,.1f} GiB of position tables, "
            f"more than this machine's {memory / 2**30:,.1f} GiB of memory"
        )
    rows = -(-m.vocab_size // m.pad_vocab_to) * m.pad_vocab_to
    blocks = m.n_layer * (4 + 2 * m.mlp_ratio) * m.n_embd**2
    embeddings = (1 if f.tie_embeddings else 2) * rows * m.n_embd + f.value_tables * rows * m.n_embd
    weights = 4 * (blocks + embeddings) + positions
    if weights > memory:
        raise ConfigError(
            f"model.n_layer={m.n_layer}, n_embd={m.n_embd}, mlp_ratio={m.mlp_ratio}, "
            f"vocab_size={m.vocab_size} make {weights / 2**30:,.1f} GiB of fp32 weights, more than "
            f"this machine's {memory / 2**30:,.1f} GiB of memory"
        )


# the optim keys optim.name=adamw reads (optim/build.py, the loop's clip and Tail-EMA readout)
ADAMW_READS = frozenset(
    {"name", "lr", "weight_decay", "betas", "eps", "grad_clip", "labels"}
    | {"tail_ema_tau", "tail_ema_start", "tail_ema_end", "tail_ema_lambda"}
)


def _validate_normuon(cfg: Config) -> None:
    """Checks of the 2025–26 optimizer switches (optim/sharded.py)."""
    o, m, f = cfg.optim, cfg.model, model_facts(cfg.model)
    smear, attn_gate, ve_gate, skip_gate, x0_apart = f.gates
    if o.adam_weight_decay and o.name == "adamw":
        raise ConfigError(
            "optim.adam_weight_decay needs optim.name=muon or normuon (adamw: optim.weight_decay)"
        )
    given = sorted(k for k in cfg.fixed if k.startswith("optim."))
    unread = [k for k in given if k.removeprefix("optim.").split(".")[0] not in ADAMW_READS]
    if o.name == "adamw" and unread:  # one AdamW for every parameter: the Muon/NorMuon keys feed nothing
        raise ConfigError(
            f"{unread[0]} has no effect under optim.name=adamw (it reads optim.lr, weight_decay, betas, eps, "
            "grad_clip, labels and tail_ema_*)"
        )
    adamw_only = [k for k in given if k in ("optim.lr", "optim.weight_decay")]  # only AdamW reads them
    if "optim.betas" in given and o.name in TABLE_OPTIMIZERS:
        raise ConfigError(
            f"optim.betas has no effect under optim.name={o.name} (its Adam rows take optim.embed_betas, "
            "value_embed_betas, scalar_betas and x0_betas)"
        )
    if adamw_only and o.name != "adamw":
        raise ConfigError(
            f"{adamw_only[0]} has no effect under optim.name={o.name} (only adamw reads it; the Adam groups "
            "take optim.embed_lr, head_lr, scalar_lr and adam_weight_decay, the matrices optim.muon_lr)"
        )
    pinned = o.muon_soap or o.muon_radius_pin or o.muon_uw_floor or o.muon_post_pin_cwd or o.muon_hyperball
    if pinned and (o.name != "muon" or f.fused_qkv):
        raise ConfigError(
            "optim.muon_soap, muon_radius_pin, muon_uw_floor, muon_post_pin_cwd and muon_hyperball need "
            "optim.name=muon and model.fused_qkv=false"
        )
    if o.muon_hyperball and (o.muon_radius_pin or o.muon_weight_decay):
        raise ConfigError(
            "optim.muon_hyperball (MuonH) keeps ‖W‖ itself: it takes no optim.muon_radius_pin or "
            "muon_weight_decay"
        )
    # (every number here is >= 0 already: check_fields ran first)
    if o.ema_nesterov_step and (o.name != "muon" or not o.ema_nesterov_start < o.ema_nesterov_end):
        raise ConfigError(
            "optim.ema_nesterov_step (#46: 0.3): it needs optim.name=muon and "
            "0 <= optim.ema_nesterov_start < optim.ema_nesterov_end"
        )
    if o.power_cool_end and (o.name != "muon" or min(o.power_cool_c) == 0):
        raise ConfigError(
            "optim.power_cool_end (#46: 2900) needs optim.name=muon and optim.power_cool_c, "
            "four coefficients > 0 (embed, head, matrix, scalar)"
        )
    if not o.scalar_bias_correction and (o.name != "muon" or o.adam_weight_decay):
        raise ConfigError(
            "optim.scalar_bias_correction=false (#46's aux Adam) needs optim.name=muon and no "
            "optim.adam_weight_decay"
        )
    if o.tail_ema_tau and not 1 <= o.tail_ema_start < o.tail_ema_end:
        raise ConfigError("optim.tail_ema_tau needs 1 <= optim.tail_ema_start < optim.tail_ema_end")
    if o.name not in TABLE_OPTIMIZERS:  # its keys: config/subkeys.py
        return
    ns_keys = ("optim.muon_backend", "optim.muon_ns_steps", "optim.muon_ns_form")
    cascade = [k for k in ns_keys if k in cfg.fixed]
    if o.name == "anvil" and cascade:
        raise ConfigError(
            f"{cascade[0]} has no effect under optim.name=anvil (its cascade is #92's six maps; "
            "optim.muon_ns_dtype sets its precision)"
        )
    if o.value_embed_every4_from and (o.value_embed_every4_from % 4 or o.adam_every != 2):
        raise ConfigError(
            f"optim.value_embed_every4_from ({o.value_embed_every4_from}) must be a multiple of 4 and needs "
            "optim.adam_every=2 (#92: every other step, then every 4th from step 336)"
        )
    if 0 in (o.attn_lr_mul, o.mlp_proj_lr_mul, o.mlp_fc_lr_mul):
        raise ConfigError(
            f"optim.name={o.name} needs optim.attn_lr_mul, optim.mlp_proj_lr_mul and mlp_fc_lr_mul > 0"
        )
    if o.muon_qk_block_heads and (m.n_head % o.muon_qk_block_heads or (f.fused_qkv and not o.muon_split_qkv)):
        raise ConfigError(
            f"optim.muon_qk_block_heads ({o.muon_qk_block_heads}) must divide model.n_head ({m.n_head}) "
            "and needs optim.muon_split_qkv=true"
        )
    if o.grad_clip > 0:
        raise ConfigError(f"optim.grad_clip is not supported with optim.name={o.name}")
    # an LR for a part the model lacks is refused when the user gave it; a recipe's stays quiet when a
    # switch removes the part (as its stated label rows do), so one switch can take a part out (ablate)
    user = cfg.fixed
    if o.smear_gate_lr and not smear and "optim.smear_gate_lr" in user:
        raise ConfigError("optim.smear_gate_lr (#52: Adam trains the smear gate) needs model.smear")
    if o.gate_lr and not (attn_gate or ve_gate) and "optim.gate_lr" in user:
        raise ConfigError("optim.gate_lr (#56: Adam trains the gates) needs model.attn_gate")
    if o.x0_lr and not x0_apart and "optim.x0_lr" in user:
        raise ConfigError("optim.x0_lr needs model.x0_lambda_apart=true (#52's x0 group)")
    if o.gate_lr_mul != 1 and (o.gate_lr or not (attn_gate or ve_gate)):  # (> 0: its declared range)
        why = f"optim.gate_lr={o.gate_lr} gives them to Adam" if o.gate_lr else "this model has none"
        raise ConfigError(
            f"optim.gate_lr_mul={o.gate_lr_mul} has no effect: it scales the gates NorMuon trains "
            f"(model.attn_gate or ve_gate with optim.gate_lr=0), and {why}; drop optim.gate_lr_mul"
        )
    lone_lr = o.skip_gate_lr and not skip_gate and "optim.skip_gate_lr" in user
    if (skip_gate and not o.skip_gate_lr) or lone_lr:
        raise ConfigError("model.skip_gate and optim.skip_gate_lr (#55: its Adam LR, > 0) go together")
    if o.tie_until:
        if f.tie_embeddings or f.zero_init_head or not f.pad_embeddings or f.embed_dtype != "fp32":
            raise ConfigError(
                "optim.tie_until needs model.tie_embeddings=false, zero_init_head=false, pad_embeddings=true "
                "and embed_dtype=fp32 (the optimizer ties two separate matrices of one shape)"
            )
        if o.tie_until % o.adam_every:
            raise ConfigError(
                f"optim.tie_until ({o.tie_until}) must be a multiple of optim.adam_every ({o.adam_every}): "
                "the untie step must be one where Adam steps"
            )
