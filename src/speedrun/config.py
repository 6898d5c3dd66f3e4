"""Typed run configuration: recipes are TOML data validated against these dataclasses.

Every technique of the record history is a field here, so a recipe is a short list of switches and
numbers. Unknown keys and values of the wrong type are errors (ConfigError), never ignored.

The field's type is the whole contract, so a new field is checked by declaring it:
- a string choice is a `Literal[...]`: the allowed values come from the type (`choices`);
- a number is finite and >= 0 unless its type says otherwise: `Annotated[int, Range(...)]` or one of
  the aliases below (PosInt, PosFloat, Fraction, Beta, ...). `validate` checks every field this way
  before the cross-field rules, so nothing runs with a NaN learning rate or zero heads.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from speedrun.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric field. Every number must also be finite (no nan or inf)."""

    lo: float = 0
    hi: float | None = None
    lo_open: bool = False  # lo itself excluded
    hi_open: bool = False  # hi itself excluded

    def check(self, key: str, value: float) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
        low_ok = value > self.lo if self.lo_open else value >= self.lo
        high_ok = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        if not (low_ok and high_ok):
            raise ConfigError(f"{key} must be {self.describe()}, got {value}")

    def describe(self) -> str:
        low = f"{'>' if self.lo_open else '>='} {self.lo:,}"
        if self.hi is None:
            return low
        return f"{low} and {'<' if self.hi_open else '<='} {self.hi:,}"


DEFAULT_RANGE = Range(0)  # numbers without an Annotated range: finite and not negative
# Sequence lengths: positions are int32 in FlexAttention block masks and in the shard header's token
# count, so nothing longer can be addressed; the memory check in `validate` bounds the tables further.
MAX_SEQ_LEN = 2**31 - 1
PosInt = Annotated[int, Range(1)]
PosFloat = Annotated[float, Range(0, lo_open=True)]
Fraction = Annotated[float, Range(0, 1)]
Beta = Annotated[float, Range(0, 1, hi_open=True)]  # Adam's betas: 1 would never forget
SeqLen = Annotated[int, Range(1, MAX_SEQ_LEN)]
Seed = Annotated[int, Range(0, 2**63 - 1)]  # torch.manual_seed takes a 64-bit seed


@dataclass
class ModelConfig:
    """Shape and architecture switches of the GPT (see model/gpt.py)."""

    vocab_size: PosInt = 50257
    pad_vocab_to: PosInt = 128  # round embedding/head rows up to a multiple of this (1 = no padding)
    n_layer: PosInt = 12
    n_head: PosInt = 12
    n_embd: PosInt = 768
    mlp_ratio: PosInt = 4
    max_seq_len: SeqLen = 1024  # learned positions / rotary table length
    positional: Literal["learned", "rotary"] = "learned"
    rope_base: PosFloat = 10000.0
    # "layernorm" (with gains and biases) | "rmsnorm" (parameter-free)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    activation: Literal["gelu", "relu2"] = "gelu"
    bias: bool = True  # biases in every Linear
    fused_qkv: bool = True  # one (3d, d) QKV matrix (GPT-2) instead of separate q, k, v
    qk_norm: bool = False  # RMSNorm on queries and keys (before rotary)
    embed_norm: bool = False  # RMSNorm right after the token embedding
    tie_embeddings: bool = True
    zero_init_proj: bool = False  # zero-init attention and MLP output projections
    zero_init_head: bool = False  # zero-init the (untied) lm_head
    # gpt2: normal 0.02, residual projections scaled | torch: PyTorch default
    # | scaled-uniform: uniform, std 0.5/sqrt(fan_in) (Sub3Min)
    init: Literal["gpt2", "torch", "scaled-uniform"] = "gpt2"
    attn_residual_scale: bool = False  # scale attention output by 1/sqrt(2*n_layer) (2024-10-10)
    logit_softcap: float = 0.0  # tanh softcap value; 0 disables
    document_mask: bool = False  # attention never crosses end-of-text boundaries
    eot_id: int = 50256  # token that starts every document (used by document_mask)
    # --- 2024-11 … 2025-01 records (model/attention.py, model/gpt.py); every default = off ---
    # auto (FlexAttention on CUDA when a doc mask/window is needed) | sdpa | flex
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    window: int = 0  # sliding window in tokens (final value when warmed up); 0 = unlimited
    # token | block (Sub3Min: whole 128-token blocks enter/leave)
    window_granularity: Literal["token", "block"] = "token"
    # none | floor (2024-11-24) | ceil (Sub3Min); see attention.window_tokens
    window_warmup: Literal["none", "floor", "ceil"] = "none"
    window_warmup_start: int = 64  # s0 of the warmup formulas
    window_unit: PosInt = 64  # the window grows in multiples of this many tokens
    window_pattern: str = ""  # per layer L (long) / S (short = half of long), e.g. LSSSLSSLSSSL; "" = all L
    # U-Net skips: encoder layer i's output is added (learned weight) to layer L-1-i's input
    unet: bool = False
    x0_shortcut: bool = False  # block input = λ0·x + λ1·x0, x0 = the (normed) embedding; λ init (1, 0)
    value_residual: bool = False  # mix every layer's v with the first layer's v (2024-11-06)
    # none | per-layer (12-04) | unet (12-08) | ends (Sub3Min: 0,1,2,…,0,1,2)
    value_embeds: Literal["none", "per-layer", "unet", "ends"] = "none"
    value_embed_tables: PosInt = 3  # number of tables for value_embeds = "ends"
    # lerp: v = (1-λ)v + λ·other, λ=0.5 | lambdas: v = λ0·v + λ1·other, (0.5, 0.5)
    value_mix: Literal["lerp", "lambdas"] = "lerp"
    pad_embeddings: bool = True  # pad token/value embedding rows like the head (Sub3Min: only the head)
    # tanh: c·tanh(z/c) | sigmoid: 2c·sigmoid(2z/c) (Sub3Min, = tanh form + c)
    softcap_form: Literal["tanh", "sigmoid"] = "tanh"
    attn_scale: float = 0.0  # attention logit scale; 0 = 1/sqrt(head_dim) (Sub3Min: 0.12)
    rope_half_truncated: bool = False  # Sub3Min RoPE: head_dim/4 frequencies 1…1/1024, the rest unrotated
    no_attention_layers: str = ""  # comma-separated layers that have only an MLP (Sub3Min: "7")
    # fp32 | bf16 (token/value embeddings stored in bf16, records from 11-08)
    embed_dtype: Literal["fp32", "bf16"] = "fp32"


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

    # "adamw" (one AdamW for everything) | "muon" (Muon matrices + Adam rest)
    name: Literal["adamw", "muon"] = "adamw"
    # AdamW baseline
    lr: float = 6e-4
    weight_decay: float = 0.1  # applied to >= 2-D parameters only
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    eps: PosFloat = 1e-8
    grad_clip: float = 0.0  # max global grad norm; 0 disables
    # Muon for the transformer's 2-D matrices
    muon_lr: float = 0.02
    muon_momentum: Fraction = 0.95
    muon_momentum_start: Fraction = 0.95  # momentum warmup from this value ...
    muon_momentum_warmup_steps: int = 0  # ... to muon_momentum over this many steps
    muon_backend: Literal["newton_schulz", "polar_express", "svd"] = "newton_schulz"
    muon_ns_steps: PosInt = 5
    muon_shape_scale: Literal["ratio", "max_dim", "rms"] = "ratio"
    muon_weight_decay: float = 0.0
    # Adam groups that go with Muon
    embed_lr: float = 0.3
    head_lr: float = 0.002
    scalar_lr: float = 0.02


@dataclass
class TrainConfig:
    """Batch, schedule, evaluation and runtime settings."""

    steps: PosInt = 100
    global_batch_tokens: PosInt = 524288  # tokens per optimizer step, whatever the world size
    micro_batch_tokens: PosInt = 65536  # tokens per process per forward/backward
    seq_len: SeqLen = 1024
    warmup_steps: int = 0
    warmdown_steps: int = 0  # linear decay over the last N steps (schedule "trapezoid")
    # "trapezoid" (warmup, constant, linear warmdown) | "cosine"
    schedule: Literal["trapezoid", "cosine"] = "trapezoid"
    final_lr_frac: Fraction = 0.0  # LR floor as a fraction of the peak
    val_every: int = 0  # 0 = only at the end
    val_tokens: PosInt = 10485760
    log_every: PosInt = 1
    timing_warmup_steps: int = 10  # first steps (compile, allocator warm-up) not timed
    dtype: Literal["bf16", "fp32"] = "bf16"  # autocast dtype: bf16 | fp32
    compile: Literal["auto", "on", "off"] = "auto"  # auto (on for CUDA only) | on | off
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto | cpu | cuda
    seed: Seed = 1337
    checkpoint_every: int = 0  # save a checkpoint every N steps (0 = never, except as below)
    checkpoint_at_end: bool = False  # save one after the last step
    checkpoint_keep: int = 2  # keep the newest K checkpoints (0 = keep all)


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


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _strip(typ: Any) -> tuple[Any, Range | None]:
    """(the plain type, its Range) of a possibly Annotated type."""
    if typing.get_origin(typ) is Annotated:
        base, *extras = typing.get_args(typ)
        return base, next((e for e in extras if isinstance(e, Range)), None)
    return typ, None


def choices(key: str) -> tuple[str, ...] | None:
    """Allowed values of a string-choice key (from its Literal type), or None for free-form fields."""
    section, _, name = key.partition(".")
    cls = _sections().get(section)
    if cls is None or name not in _field_types(cls):
        return None
    typ, _ = _strip(_field_types(cls)[name])
    return typing.get_args(typ) if typing.get_origin(typ) is Literal else None


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Convert a TOML value or command-line string to the field's type, or raise ConfigError."""
    typ, bounds = _strip(typ)
    origin = typing.get_origin(typ)
    if origin is Literal:
        allowed = typing.get_args(typ)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")
        return value
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
    if typ in (int, float):
        number = _number(key, value, typ)
        (bounds or DEFAULT_RANGE).check(key, number)
        return number
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {typ}")  # pragma: no cover - programming error


def _number(key: str, value: Any, typ: type) -> int | float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected {'an integer' if typ is int else 'a number'}, got {value!r}")
    if typ is int:
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected a number, got {value!r}")


def check_fields(cfg: Config) -> None:
    """Every field against its declared type, range and choices (defaults and direct edits included)."""
    for section, cls in _sections().items():
        obj = getattr(cfg, section)
        for name, typ in _field_types(cls).items():
            _coerce(f"{section}.{name}", getattr(obj, name), typ)


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
    """A recipe file's table; any unreadable, non-UTF-8 or invalid file is one ConfigError line."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"recipe file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"recipe file {path} is a directory, not a .toml file") from None
    except OSError as e:
        raise ConfigError(f"recipe file {path} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"recipe file {path} is not UTF-8 text (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"recipe file {path} is not valid TOML: {e}") from None


def validate(cfg: Config) -> None:
    """Every field's own range first, then the cross-field checks that do not depend on the world size."""
    check_fields(cfg)
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
    if t.warmup_steps + t.warmdown_steps > t.steps and t.schedule == "trapezoid":
        raise ConfigError(
            f"train.warmup_steps + train.warmdown_steps ({t.warmup_steps + t.warmdown_steps}) "
            f"exceed train.steps ({t.steps})"
        )
    if m.tie_embeddings and m.zero_init_head:
        raise ConfigError(
            "model.zero_init_head needs model.tie_embeddings=false (a zero embedding cannot learn)"
        )
    if m.document_mask and m.eot_id >= m.vocab_size:
        raise ConfigError(f"model.eot_id ({m.eot_id}) must be below model.vocab_size ({m.vocab_size})")
    if cfg.data.tokenizer != "gpt2":
        from speedrun.data.tokenizers import parse_bpe_size

        try:
            parse_bpe_size(cfg.data.tokenizer)
        except ConfigError as e:
            raise ConfigError(f"data.tokenizer: {e}") from None
    _validate_model_switches(m)
    _check_memory(m)


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_memory(m: ModelConfig) -> None:
    """Refuse models whose fp32 weights alone cannot fit in this machine's memory.

    The model is built on the host before it moves to a GPU, so its fp32 parameters and position
    tables must fit in physical memory: an absurd size (max_seq_len=2e9, n_embd=1e6) is then one
    line naming the key instead of an allocator failure. Counts are estimates (within a few %).
    """
    memory = _physical_memory()
    if memory is None:
        return
    head_dim = m.n_embd // m.n_head
    per_position = m.n_embd if m.positional == "learned" else m.n_layer * head_dim  # rotary: cos+sin
    positions = 4 * m.max_seq_len * per_position
    if positions > memory:
        raise ConfigError(
            f"model.max_seq_len={m.max_seq_len} needs a {positions / 2**30:,.1f} GiB position table, "
            f"more than this machine's {memory / 2**30:,.1f} GiB of memory"
        )
    rows = -(-m.vocab_size // m.pad_vocab_to) * m.pad_vocab_to
    tables = {"none": 0, "per-layer": m.n_layer, "unet": m.n_layer // 2, "ends": m.value_embed_tables}
    blocks = m.n_layer * (4 + 2 * m.mlp_ratio) * m.n_embd**2
    embeddings = (1 if m.tie_embeddings else 2) * rows * m.n_embd + tables[m.value_embeds] * rows * m.n_embd
    weights = 4 * (blocks + embeddings) + positions
    if weights > memory:
        raise ConfigError(
            f"model.n_layer={m.n_layer}, n_embd={m.n_embd}, mlp_ratio={m.mlp_ratio}, "
            f"vocab_size={m.vocab_size} make {weights / 2**30:,.1f} GiB of fp32 weights, more than "
            f"this machine's {memory / 2**30:,.1f} GiB of memory"
        )


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
