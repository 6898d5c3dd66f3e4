"""Typed run configuration: recipes are TOML data validated against these dataclasses.

Every technique of the record history is a field here, so a recipe is a short list of switches and
numbers. Unknown keys and values of the wrong type are errors (ConfigError), never ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedrun.errors import ConfigError


@dataclass
class ModelConfig:
    """Shape and architecture switches of the GPT (see model/gpt.py)."""

    vocab_size: int = 50257
    pad_vocab_to: int = 128  # round embedding/head rows up to a multiple of this (1 = no padding)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    mlp_ratio: int = 4
    max_seq_len: int = 1024  # learned positions / rotary table length
    positional: str = "learned"  # "learned" (GPT-2) | "rotary"
    rope_base: float = 10000.0
    norm: str = "layernorm"  # "layernorm" (with gains and biases) | "rmsnorm" (parameter-free)
    activation: str = "gelu"  # "gelu" | "relu2"
    bias: bool = True  # biases in every Linear
    fused_qkv: bool = True  # one (3d, d) QKV matrix (GPT-2) instead of separate q, k, v
    qk_norm: bool = False  # RMSNorm on queries and keys (before rotary)
    embed_norm: bool = False  # RMSNorm right after the token embedding
    tie_embeddings: bool = True
    zero_init_proj: bool = False  # zero-init attention and MLP output projections
    zero_init_head: bool = False  # zero-init the (untied) lm_head
    init: str = "gpt2"  # "gpt2" (normal 0.02, residual projections scaled) | "torch" (PyTorch default)
    #                     | "scaled-uniform" (uniform, std 0.5/sqrt(fan_in): Sub3Min)
    attn_residual_scale: bool = False  # scale attention output by 1/sqrt(2*n_layer) (2024-10-10)
    logit_softcap: float = 0.0  # tanh softcap value; 0 disables
    document_mask: bool = False  # attention never crosses end-of-text boundaries
    eot_id: int = 50256  # token that starts every document (used by document_mask)
    # --- 2024-11 … 2025-01 records (model/attention.py, model/gpt.py); every default = off ---
    attention: str = "auto"  # auto (FlexAttention on CUDA when a doc mask/window is needed) | sdpa | flex
    window: int = 0  # sliding window in tokens (final value when warmed up); 0 = unlimited
    window_granularity: str = "token"  # token | block (Sub3Min: whole 128-token blocks enter/leave)
    window_warmup: str = "none"  # none | floor (2024-11-24) | ceil (Sub3Min); see schedule.window_tokens
    window_warmup_start: int = 64  # s0 of the warmup formulas
    window_unit: int = 64  # the window grows in multiples of this many tokens
    window_pattern: str = ""  # per layer L (long) / S (short = half of long), e.g. LSSSLSSLSSSL; "" = all L
    unet: bool = (
        False  # U-Net skips: encoder layer i's output is added (learned weight) to layer L-1-i's input
    )
    x0_shortcut: bool = False  # block input = λ0·x + λ1·x0, x0 = the (normed) embedding; λ init (1, 0)
    value_residual: bool = False  # mix every layer's v with the first layer's v (2024-11-06)
    value_embeds: str = "none"  # none | per-layer (12-04) | unet (12-08) | ends (Sub3Min: 0,1,2,…,0,1,2)
    value_embed_tables: int = 3  # number of tables for value_embeds = "ends"
    value_mix: str = "lerp"  # lerp: v = (1-λ)v + λ·other, λ=0.5 | lambdas: v = λ0·v + λ1·other, (0.5, 0.5)
    pad_embeddings: bool = True  # pad token/value embedding rows like the head (Sub3Min: only the head)
    softcap_form: str = "tanh"  # tanh: c·tanh(z/c) | sigmoid: 2c·sigmoid(2z/c) (Sub3Min, = tanh form + c)
    attn_scale: float = 0.0  # attention logit scale; 0 = 1/sqrt(head_dim) (Sub3Min: 0.12)
    rope_half_truncated: bool = False  # Sub3Min RoPE: head_dim/4 frequencies 1…1/1024, the rest unrotated
    no_attention_layers: str = ""  # comma-separated layers that have only an MLP (Sub3Min: "7")
    embed_dtype: str = "fp32"  # fp32 | bf16 (token/value embeddings stored in bf16, records from 11-08)
    # --- numerics of individual records (docs/recipes.md); defaults = today's behaviour ---
    gelu: str = "tanh"  # tanh | erf (exact GELU: the 2024-10-04 seed and 10-10)
    norm_eps: float = 0.0  # RMSNorm epsilon; 0 = F.rms_norm's default (the dtype's machine epsilon)
    norm_fp32: bool = False  # RMSNorm computed in fp32 and cast back (2024-10-04 / 10-10, eps 1e-6)
    rope_precision: str = "auto"  # auto (activation dtype; fp32 for half-truncated) | fp32 (10-10)
    #   | bf16 (cos/sin tables rounded to bf16: 10-14 … 11-24) | bf16-angles (12-04/12-08: bf16
    #   inverse frequencies and angles, as model.bfloat16() leaves them)
    qk_norm_after_rotary: bool = False  # QK-norm applied after rotary (2024-10-14 only)
    bf16_model: bool = False  # every parameter but the Linear weights in bf16 (11-08 … 12-08)
    window_block_list: bool = False  # 12-08: kv blocks listed only while q_block − kv_block < ceil(w/128)
    sdpa_kernel: str = "auto"  # auto | cudnn | flash | efficient | math: SDPA backend forced on CUDA
    fp8_head: bool = False  # Sub3Min: lm_head matmul in FP8 (e4m3 forward, e5m2 gradients) when training


@dataclass
class DataConfig:
    """Where tokens come from; `speedrun prepare` builds the shards this points at."""

    source: str = "wiki-vital"  # wiki-vital | text:PATH | fineweb10B[:N]
    tokenizer: str = "gpt2"  # gpt2 | bpe:N
    dir: str = ""  # shard folder; empty = the default folder of source + tokenizer
    align_to_bos: bool = False  # start every micro-batch at a document start


@dataclass
class OptimConfig:
    """Optimizer choice and hyperparameters. Learning rates are peak values before the schedule."""

    name: str = "adamw"  # "adamw" (one AdamW for everything) | "muon" (Muon matrices + Adam rest)
    # AdamW baseline
    lr: float = 6e-4
    weight_decay: float = 0.1  # applied to >= 2-D parameters only
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 0.0  # max global grad norm; 0 disables
    # Muon for the transformer's 2-D matrices
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_momentum_start: float = 0.95  # momentum warmup from this value ...
    muon_momentum_warmup_steps: int = 0  # ... to muon_momentum over this many steps
    muon_backend: str = "newton_schulz"  # newton_schulz | polar_express | svd
    muon_ns_steps: int = 5
    muon_shape_scale: str = "ratio"  # ratio | max_dim | rms
    muon_weight_decay: float = 0.0
    # Adam groups that go with Muon
    embed_lr: float = 0.3
    head_lr: float = 0.002
    scalar_lr: float = 0.02
    # Muon numerics of individual records (defaults = today's behaviour)
    muon_momentum_form: str = "ema"  # ema (lerp; 12-08 on) | sgd (buf = m·buf + g, g + m·buf; to 12-04)
    muon_ns_form: str = "fused"  # fused | 2024-10-10 | 2024-10-14 | 2024-11-10 (optim/orthogonalize.py)
    muon_split_qkv: bool = True  # orthogonalize a fused QKV as three matrices (false: the 2024-10-04 seed)
    muon_scale_in_bf16: bool = False  # multiply the bf16 update by its shape scale in bf16 (10-17 … 12-04)


@dataclass
class TrainConfig:
    """Batch, schedule, evaluation and runtime settings."""

    steps: int = 100
    global_batch_tokens: int = 524288  # tokens per optimizer step, whatever the world size
    micro_batch_tokens: int = 65536  # tokens per process per forward/backward
    seq_len: int = 1024
    warmup_steps: int = 0
    warmdown_steps: int = 0  # linear decay over the last N steps (schedule "trapezoid")
    warmdown_frac: float = 0.0  # warmdown over this fraction of the steps instead (Sub3Min: 0.4)
    schedule: str = "trapezoid"  # "trapezoid" (warmup, constant, linear warmdown) | "cosine"
    final_lr_frac: float = 0.0  # LR floor as a fraction of the peak
    val_every: int = 0  # 0 = only at the end
    val_tokens: int = 10485760
    log_every: int = 10  # log points: the only steps where the host waits for the device
    timing_warmup_steps: int = 10  # first steps (compile, allocator warm-up) not timed
    dtype: str = "bf16"  # autocast dtype: bf16 | fp32
    compile: str = "auto"  # auto (on for CUDA only) | on | off
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 1337
    checkpoint_every: int = 0  # save a checkpoint every N steps (0 = never, except as below)
    checkpoint_at_end: bool = False  # save one after the last step
    checkpoint_keep: int = 2  # keep the newest K checkpoints (0 = keep all)
    sample_every: int = 0  # log a few fixed-prompt greedy samples every N steps (0 = never)
    wandb_project: str = ""  # also log to this Weights & Biases project (needs wandb; "" = off)
    val_autocast: bool = True  # validate under the training autocast; false: fp32 (2024-10-04 / 10-10)


@dataclass
class Config:
    """A complete, resolved run configuration."""

    recipe: str = "custom"
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CHOICES: dict[str, tuple[str, ...]] = {
    "model.positional": ("learned", "rotary"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.activation": ("gelu", "relu2"),
    "model.init": ("gpt2", "torch", "scaled-uniform"),
    "model.attention": ("auto", "sdpa", "flex"),
    "model.window_granularity": ("token", "block"),
    "model.window_warmup": ("none", "floor", "ceil"),
    "model.value_embeds": ("none", "per-layer", "unet", "ends"),
    "model.value_mix": ("lerp", "lambdas"),
    "model.softcap_form": ("tanh", "sigmoid"),
    "model.embed_dtype": ("fp32", "bf16"),
    "model.gelu": ("tanh", "erf"),
    "model.rope_precision": ("auto", "fp32", "bf16", "bf16-angles"),
    "model.sdpa_kernel": ("auto", "cudnn", "flash", "efficient", "math"),
    "optim.muon_momentum_form": ("ema", "sgd"),
    "optim.muon_ns_form": ("fused", "2024-10-10", "2024-10-14", "2024-11-10"),
    "optim.name": ("adamw", "muon"),
    "optim.muon_backend": ("newton_schulz", "polar_express", "svd"),
    "optim.muon_shape_scale": ("ratio", "max_dim", "rms", "none"),
    "train.schedule": ("trapezoid", "cosine"),
    "train.dtype": ("bf16", "fp32"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.compile": ("auto", "on", "off"),
}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Convert a TOML value or command-line string to the field's type, or raise ConfigError."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):  # Optional[...]
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(key, value, args[0])
    if origin is tuple:
        args = typing.get_args(typ)
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} comma-separated values, got {value!r}")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args, strict=True))
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {typ}")  # pragma: no cover - programming error


def _unknown_key(key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def all_keys() -> list[str]:
    """Every dotted key a recipe or override may set."""
    keys = ["recipe", "description"]
    for section, cls in _sections().items():
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def _sections() -> dict[str, type]:
    return {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig}


def set_value(cfg: Config, key: str, value: Any) -> None:
    """Set one dotted key (e.g. 'model.n_layer') with type checking."""
    if key in ("recipe", "description"):
        setattr(cfg, key, _coerce(key, value, str))
        return
    section, _, name = key.partition(".")
    sections = _sections()
    if section not in sections or name not in _field_types(sections[section]):
        raise _unknown_key(key, all_keys())
    typed = _coerce(key, value, _field_types(sections[section])[name])
    if key in CHOICES and typed not in CHOICES[key]:
        raise ConfigError(f"{key}: {typed!r} is not one of {', '.join(CHOICES[key])}")
    setattr(getattr(cfg, section), name, typed)


def apply_table(cfg: Config, table: dict[str, Any], origin: str) -> None:
    """Apply a nested TOML table ({'model': {'n_layer': 4}, ...}) onto cfg."""
    for key, value in table.items():
        if key == "base":
            continue
        if isinstance(value, dict):
            if key not in _sections():
                raise ConfigError(f"{origin}: unknown config section '{key}'")
            for sub, subval in value.items():
                set_value(cfg, f"{key}.{sub}", subval)
        else:
            set_value(cfg, key, value)


def parse_overrides(cfg: Config, overrides: list[str]) -> None:
    """Apply command-line `key=value` overrides."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        set_value(cfg, key.strip(), value.strip())


# Settings that may differ when a run is resumed: they change how a run is observed, not what it computes.
RESUMABLE_CHANGES = (
    "description",
    "model.attention",  # the backends compute the same attention
    "train.val_every",
    "train.log_every",
    "train.timing_warmup_steps",
    "train.compile",
    "train.device",
    "train.checkpoint_every",
    "train.checkpoint_at_end",
    "train.checkpoint_keep",
    "train.sample_every",
    "train.wandb_project",
)


def config_from_dict(data: dict[str, Any], origin: str) -> Config:
    """Rebuild a Config from its to_dict() form (config.json), with the same type checks as recipes."""
    cfg = Config()
    apply_table(cfg, data, origin)
    return cfg


def changed_keys(old: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every dotted key whose value differs."""
    a, b = flatten(old.to_dict()), flatten(new.to_dict())
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"recipe file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"recipe file {path} is not valid TOML: {e}") from None


def validate(cfg: Config) -> None:
    """Cross-field checks that do not depend on the world size."""
    m, t = cfg.model, cfg.train
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head})")
    if m.positional == "rotary" and (m.n_embd // m.n_head) % 2:
        raise ConfigError("rotary embeddings need an even head dimension")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
    if t.micro_batch_tokens % t.seq_len:
        raise ConfigError(
            f"train.micro_batch_tokens ({t.micro_batch_tokens}) must be a multiple of "
            f"train.seq_len ({t.seq_len})"
        )
    if t.global_batch_tokens % t.micro_batch_tokens:
        raise ConfigError(
            f"train.global_batch_tokens ({t.global_batch_tokens}) must be a multiple of "
            f"train.micro_batch_tokens ({t.micro_batch_tokens})"
        )
    if t.sample_every < 0:
        raise ConfigError(f"train.sample_every must not be negative, got {t.sample_every}")
    for key in ("steps", "global_batch_tokens", "micro_batch_tokens", "seq_len", "val_tokens", "log_every"):
        if getattr(t, key) <= 0:
            raise ConfigError(f"train.{key} must be positive, got {getattr(t, key)}")
    if t.warmup_steps + t.warmdown_steps > t.steps and t.schedule == "trapezoid":
        raise ConfigError(
            f"train.warmup_steps + train.warmdown_steps ({t.warmup_steps + t.warmdown_steps}) "
            f"exceed train.steps ({t.steps})"
        )
    if not 0 <= t.warmdown_frac <= 1:
        raise ConfigError(f"train.warmdown_frac must be between 0 and 1, got {t.warmdown_frac}")
    if m.tie_embeddings and m.zero_init_head:
        raise ConfigError(
            "model.zero_init_head needs model.tie_embeddings=false (a zero embedding cannot learn)"
        )
    _validate_model_switches(m)


def _validate_model_switches(m: ModelConfig) -> None:
    """Checks of the 2024-11 … 2025-01 architecture switches (model/gpt.py, model/attention.py)."""
    if m.window < 0 or m.window_unit <= 0 or m.window_warmup_start < 0:
        raise ConfigError(
            "model.window, model.window_unit and model.window_warmup_start must not be negative"
        )
    if m.window_warmup != "none" and m.window <= 0:
        raise ConfigError(f"model.window_warmup={m.window_warmup} needs model.window > 0 (the final window)")
    if m.window_pattern and (len(m.window_pattern) != m.n_layer or set(m.window_pattern) - set("LS")):
        raise ConfigError(
            f"model.window_pattern {m.window_pattern!r} must have one L or S per layer ({m.n_layer} layers)"
        )
    if "S" in m.window_pattern and m.window <= 0:
        raise ConfigError("model.window_pattern with short (S) layers needs model.window > 0")
    try:
        no_attn = {int(s) for s in m.no_attention_layers.split(",") if s.strip()}
    except ValueError:
        raise ConfigError(
            f"model.no_attention_layers: expected comma-separated layer numbers, "
            f"got {m.no_attention_layers!r}"
        ) from None
    if any(not 0 <= i < m.n_layer for i in no_attn):
        raise ConfigError(
            f"model.no_attention_layers {m.no_attention_layers!r}: layers are 0..{m.n_layer - 1}"
        )
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
    if m.attn_scale < 0 or m.logit_softcap < 0:
        raise ConfigError("model.attn_scale and model.logit_softcap must not be negative")
