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
    attn_residual_scale: bool = False  # scale attention output by 1/sqrt(2*n_layer) (2024-10-10)
    logit_softcap: float = 0.0  # tanh softcap value; 0 disables
    document_mask: bool = False  # attention never crosses end-of-text boundaries
    eot_id: int = 50256  # token that starts every document (used by document_mask)


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


@dataclass
class TrainConfig:
    """Batch, schedule, evaluation and runtime settings."""

    steps: int = 100
    global_batch_tokens: int = 524288  # tokens per optimizer step, whatever the world size
    micro_batch_tokens: int = 65536  # tokens per process per forward/backward
    seq_len: int = 1024
    warmup_steps: int = 0
    warmdown_steps: int = 0  # linear decay over the last N steps (schedule "trapezoid")
    schedule: str = "trapezoid"  # "trapezoid" (warmup, constant, linear warmdown) | "cosine"
    final_lr_frac: float = 0.0  # LR floor as a fraction of the peak
    val_every: int = 0  # 0 = only at the end
    val_tokens: int = 10485760
    log_every: int = 1
    timing_warmup_steps: int = 10  # first steps (compile, allocator warm-up) not timed
    dtype: str = "bf16"  # autocast dtype: bf16 | fp32
    compile: str = "auto"  # auto (on for CUDA only) | on | off
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 1337


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
    "model.init": ("gpt2", "torch"),
    "optim.name": ("adamw", "muon"),
    "optim.muon_backend": ("newton_schulz", "polar_express", "svd"),
    "optim.muon_shape_scale": ("ratio", "max_dim", "rms"),
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
            f"train.micro_batch_tokens ({t.micro_batch_tokens}) must be a multiple of train.seq_len ({t.seq_len})"
        )
    if t.global_batch_tokens % t.micro_batch_tokens:
        raise ConfigError(
            f"train.global_batch_tokens ({t.global_batch_tokens}) must be a multiple of "
            f"train.micro_batch_tokens ({t.micro_batch_tokens})"
        )
    for key in ("steps", "global_batch_tokens", "micro_batch_tokens", "seq_len", "val_tokens", "log_every"):
        if getattr(t, key) <= 0:
            raise ConfigError(f"train.{key} must be positive, got {getattr(t, key)}")
    if t.warmup_steps + t.warmdown_steps > t.steps and t.schedule == "trapezoid":
        raise ConfigError(
            f"train.warmup_steps + train.warmdown_steps ({t.warmup_steps + t.warmdown_steps}) "
            f"exceed train.steps ({t.steps})"
        )
    if m.tie_embeddings and m.zero_init_head:
        raise ConfigError("model.zero_init_head needs model.tie_embeddings=false (a zero embedding cannot learn)")
