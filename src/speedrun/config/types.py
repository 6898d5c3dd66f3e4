"""Field types of the run configuration: numeric bounds (`Range` and its aliases), and `coerce`, which
converts and checks one TOML / command-line value against a field's type."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import typing
from dataclasses import dataclass
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
        # Values reach torch as fp32 (learning rates, scales) or int64 (steps, windows): beyond those
        # they failed deep inside the first step ("value cannot be converted ... without overflow").
        limit, form = (FP32_MAX, ".4g") if isinstance(value, float) else (INT64_MAX, ",")
        if value > limit:  # (no field takes negative numbers: they fail the lower bound below)
            raise ConfigError(
                f"{key} must be at most {limit:{form}}, got {value:{form}} (what torch can hold)"
            )
        low_ok = value > self.lo if self.lo_open else value >= self.lo
        high_ok = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        if not (low_ok and high_ok):
            high = "" if self.hi is None else f" and {'<' if self.hi_open else '<='} {self.hi:,}"
            raise ConfigError(f"{key} must be {'>' if self.lo_open else '>='} {self.lo:,}{high}, got {value}")


FP32_MAX = 3.4028234663852886e38  # the largest finite float32
INT64_MAX = 2**63 - 1
DEFAULT_RANGE = Range(0)  # numbers without an Annotated range: finite and not negative
# Sequence lengths: positions are int32 in FlexAttention block masks and in the shard header's token
# count, so nothing longer can be addressed; the memory check in `validate` bounds the tables further.
MAX_SEQ_LEN = 2**31 - 1
# FlexAttention's block (tokens) and the unit of block-granular windows and of the stages' windows:
# here, not in model/attention.py, because the stage plan's checks need it and the config layer
# imports nothing from the model (docs/architecture.md)
BLOCK_SIZE = 128
PosInt = Annotated[int, Range(1)]
PosFloat = Annotated[float, Range(0, lo_open=True)]
Fraction = Annotated[float, Range(0, 1)]
Beta = Annotated[float, Range(0, 1, hi_open=True)]  # Adam's betas: 1 would never forget
SeqLen = Annotated[int, Range(1, MAX_SEQ_LEN)]
Seed = Annotated[int, Range(0, 2**63 - 1)]  # torch.manual_seed takes a 64-bit seed


def did_you_mean(word: str, known: Any) -> str:
    """The " (did you mean X?)" of an unknown key's refusal, when one of `known` is close."""
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def strip_annotation(typ: Any) -> tuple[Any, Range | None]:
    """(the plain type, its Range) of a possibly Annotated type."""
    if typing.get_origin(typ) is Annotated:
        base, *extras = typing.get_args(typ)
        return base, next((e for e in extras if isinstance(e, Range)), None)
    return typ, None


def coerce(key: str, value: Any, typ: Any) -> Any:
    """Convert a TOML value or command-line string to the field's type, or raise ConfigError."""
    if typing.get_origin(typ) is Annotated:  # a function beside the type converts and checks values whole
        parser = next((e for e in typing.get_args(typ)[1:] if callable(e)), None)
        if parser is not None:
            return parser(key, value)
    typ, bounds = strip_annotation(typ)
    origin = typing.get_origin(typ)
    if origin is Literal:
        allowed = typing.get_args(typ)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")
        return value
    if origin is tuple:
        args = typing.get_args(typ)
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} comma-separated values, got {value!r}")
        return tuple(coerce(key, v, a) for v, a in zip(value, args, strict=True))
    if origin is list:  # per-layer lists (gpt2026): a TOML array, or `[0, 2]` / `0,2` on the command line
        (item,) = typing.get_args(typ)
        if isinstance(value, str):
            value = _parse_list(key, value)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [coerce(key, v, item) for v in value]
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


def _parse_list(key: str, text: str) -> list:
    """A command-line list: JSON (`[[3, 6]]`, `["L", "S"]`) or comma-separated items (`0,2`, `L,S`)."""
    text = text.strip()
    if text.startswith("["):
        return from_json(key, text, "a list (write it as JSON, e.g. [0, 2])")
    return [v.strip() for v in text.split(",") if v.strip()]


def from_json(key: str, value: Any, what: str) -> Any:
    """A list or table given as JSON text on the command line (`[0, 2]`, `{"lr": 0.3}`); any other value
    (a TOML table, a word) as it is."""
    if not (isinstance(value, str) and value.lstrip()[:1] in ("[", "{")):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise ConfigError(f"{key}: {value!r} is not {what}") from None


def _number(key: str, value: Any, typ: type) -> int | float:
    """An int field takes an int or its text (`1_000` too), a float field any number or its text."""
    if not isinstance(value, bool) and isinstance(value, (int, str) if typ is int else (int, float, str)):
        try:
            return int(value.replace("_", "")) if isinstance(value, str) and typ is int else typ(value)
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected {'an integer' if typ is int else 'a number'}, got {value!r}")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a config section; cached, as resolving them costs about 1 ms a call
    and every override and recipe value asks (loading a recipe took 0.2 s before)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}  # not a part's ClassVar FLAT


def key_type(cls: type, path: str) -> Any | None:
    """The declared type of dotted `path` inside section class `cls` (`attn.scale` reaches into a part
    table: a nested dataclass), or None when there is no such field."""
    head, _, rest = path.partition(".")
    typ = field_types(cls).get(head)
    if not rest or typ is None:
        return typ
    return key_type(typ, rest) if dataclasses.is_dataclass(typ) else None


def canonical_key(model: Any, key: str) -> str:  # `model`: a model config or its class
    """A dotted key as this config spells it: a gpt2026 model's flat part key (`model.mudd_sources`, from
    config.json files and recipes written before the parts) → its table's (`model.mudd.sources`). The one
    place the converter applies (set_value, overrides, the keys a user fixed)."""
    section, _, name = key.partition(".")
    flat = getattr(model, "FLAT_KEYS", {})  # a family with part tables says how flat keys map
    if section == "model" and name in flat:
        return "model." + ".".join(flat[name])
    return key


def dotted_fields(cls: type, prefix: str) -> list[str]:
    """The dotted keys of section class `cls`, a part table's fields as `prefix.part.field`."""
    out = []
    for name, typ in field_types(cls).items():
        out += (
            dotted_fields(typ, f"{prefix}.{name}") if dataclasses.is_dataclass(typ) else [f"{prefix}.{name}"]
        )
    return out
