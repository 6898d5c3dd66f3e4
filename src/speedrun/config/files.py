"""Reading and changing a config: dotted keys and `key=value` overrides, recipe TOML tables, a run's
`config.json`, and the resume rule (which settings a resumed run may change). What a config *is* (its
fields, types and checks) lives in config/__init__.py; this module only fills one in, with the same checks."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speedrun.atomic import read_regular
from speedrun.config import MODEL_FAMILIES, Config, all_keys, canonical_key, field_types, key_type, sections
from speedrun.config.gpt2026 import legacy_gpt2024_table, legacy_model_table
from speedrun.config.labels import RULE_KEYS, parse_rows
from speedrun.config.types import coerce, did_you_mean
from speedrun.errors import ConfigError, SpeedrunError


def _unknown_key(key: str) -> ConfigError:
    return ConfigError(f"unknown config key '{key}'{did_you_mean(key, all_keys())}")


def set_value(cfg: Config, key: str, value: Any) -> None:
    """Set one dotted key (e.g. 'model.n_layer') with type checking."""
    if key in ("recipe", "description"):
        setattr(cfg, key, coerce(key, value, str))
        return
    if key == "optim.labels" or key.startswith("optim.labels."):
        _set_label_rows(cfg, key, value)
        return
    key = canonical_key(cfg.model, key)
    section, _, name = key.partition(".")
    typ = key_type(type(getattr(cfg, section)), name) if section in sections() else None
    if typ is None or dataclasses.is_dataclass(typ):
        other = [
            f
            for f, cls in MODEL_FAMILIES.items()
            if f != cfg.model.family and key_type(cls, canonical_key(cls, key).partition(".")[2])
        ]
        if section == "model" and other:
            raise ConfigError(f"{key} is a {other[0]} key; this model is {cfg.model.family} (model.family)")
        raise _unknown_key(key)
    typed = coerce(key, value, typ)
    if key == "model.family":  # a switch comes first, with its model keys (_switch_family)
        assert typed == cfg.model.family, (typed, cfg.model.family)
    obj, (part, _, last) = getattr(cfg, section), name.rpartition(".")
    if part:  # a part table is frozen: setting its field replaces the part
        typed = dataclasses.replace(getattr(obj, part), **{last: typed})
    setattr(obj, part or last, typed)


def _set_label_rows(cfg: Config, key: str, value: Any) -> None:
    """`[optim.labels]` (a table, or JSON text) or `optim.labels.LABEL[.KEY]=VALUE`: merged into the rows
    already stated, label by label and key by key (a recipe's rows over its base's), unless a new rule
    does not take the keys stated before (it starts the row over); an empty row (`optim.labels.gate={}`)
    or table (`optim.labels={}`) takes the stated rows back."""
    path = key.split(".")[2:]
    if len(path) > 2:
        raise _unknown_key(key)
    for part in reversed(path):
        value = {part: value}
    rows, stated = dict(cfg.optim.labels), parse_rows("optim.labels", value)
    for label, row in stated.items():  # an empty row states nothing: the label's derived row again
        before = rows.get(label, {})
        if "rule" in row and not set(before) <= set(RULE_KEYS[row["rule"]]):
            before = {}  # another rule starts the row over: the keys stated before were the old rule's
        rows[label] = {**before, **row} if row else {}
    cfg.optim.labels = {label: row for label, row in rows.items() if row} if stated or path else {}


def apply_table(cfg: Config, table: dict[str, Any], origin: str) -> None:
    """Apply a nested TOML table ({'model': {'n_layer': 4}, ...}) onto cfg, `model.family` first."""
    table = {key: value for key, value in table.items() if key != "base"}
    for key, value in table.items():
        if isinstance(value, dict) and key not in sections():
            raise ConfigError(f"{origin}: unknown config section '{key}'")
    _switch_family(cfg, table.get("model"), origin)
    items = flatten(table, rows=False)
    _one_spelling(cfg, list(items), origin)
    for key, value in items.items():
        set_value(cfg, key, value)


def _one_spelling(cfg: Config, keys: list[str], origin: str) -> None:
    """A key given twice in one table or command line under two spellings (a gpt2026 part key's flat name
    `model.attn_scale` and its table's `model.attn.scale`) is refused: one of them would be dropped
    silently (issue 46). The same spelling twice on a command line is the shell's usual "last one wins"."""
    seen: dict[str, str] = {}
    for key in keys:
        canonical = canonical_key(cfg.model, key)
        if seen.get(canonical, key) != key:
            raise ConfigError(
                f"{origin} gives {canonical} twice, as {seen[canonical]} and as {key}: one would be dropped; "
                "keep one"
            )
        seen[canonical] = key


def _switch_family(cfg: Config, model: Any, origin: str) -> None:
    """`model.family` naming another family starts that family's model from its defaults (it inherits
    nothing of the model before), so the same table or command line must give model keys beside it.
    `model`: the model table (anything else, or one without a family, changes nothing)."""
    if not isinstance(model, dict) or "family" not in model:
        return
    family = coerce("model.family", model["family"], field_types(type(cfg.model))["family"])
    if family == cfg.model.family:
        return
    if len(model) == 1 and cfg.model != type(cfg.model)():
        raise ConfigError(
            f"model.family={family} ({origin}) gives no {family} model: the {cfg.model.family} model it "
            f"replaces is not inherited, so {family}'s defaults would train; give its model.* keys too"
        )
    new, old = MODEL_FAMILIES[family](), cfg.model
    if old != type(old)():  # the model's size, which both families have, is not silently reset (issue 46)
        keys = {k: old for k in SIZE_KEYS if k not in model and getattr(new, k) != getattr(old, k)}
        if keys:
            ours = ", ".join(f"model.{k}={getattr(new, k)}" for k in keys)
            given = " ".join(f"model.{k}={getattr(old, k)}" for k in keys)
            raise ConfigError(
                f"model.family={family} ({origin}) would train {family}'s default {ours}, not the size of "
                f"the {old.family} model it replaces: give the size beside it ({given}, or other values)"
            )
    cfg.model = new


#: A model's size and its tokenizer's end-of-text id: keys both families have, which a family switch must
#: not reset unasked
SIZE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "max_seq_len", "eot_id")


def parse_overrides(cfg: Config, overrides: list[str]) -> None:
    """Apply command-line `key=value` overrides (`model.family` first, with the model keys given beside
    it: `_switch_family`); their keys join the keys the user fixed (`cfg.fixed`)."""
    pairs = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        pairs.append((key.strip(), value.strip()))
    model = {k.partition(".")[2]: v for k, v in pairs if k.startswith("model.")}
    _switch_family(cfg, model, "the command line")
    _one_spelling(cfg, [k for k, _ in pairs], "the command line")
    for key, value in pairs:
        set_value(cfg, key, value)
        cfg.fixed |= {canonical_key(cfg.model, key)}


def table_keys(table: dict[str, Any]) -> set[str]:
    """The dotted keys a recipe table sets (its `base` is a reference, not a setting)."""
    return {key for key in flatten(table, rows=False) if key != "base"}


# Settings that may differ when a run is resumed: they change how a run is observed, not what it computes.
RESUMABLE_CHANGES = (
    "description",
    "model.attention",  # the backends compute the same attention
    "train.val_every",
    "train.log_every",
    "train.timing_warmup_steps",
    "train.compile",
    "train.perf",  # kernels compute the plain ops' values (to rounding)
    "train.device",
    "train.dist_timeout_s",
    "train.checkpoint_every",
    "train.checkpoint_at_end",
    "train.checkpoint_keep",
    "data.dir",  # a moved data folder: its data must be the run's (train/plan/run_data.py `ensure_data`)
    "train.sample_every",
    "train.wandb_project",
)


#: config.json's one entry beside the config: the run's identity, made by RunDir when the run is created,
#: which copies of the folder keep (so `compare` counts a copied run once). Not a setting.
RUN_ID = "run_id"
#: config.json's entry of the keys the user fixed (Config.fixed), so a resumed run's automatic choices
#: leave the same keys alone. A list of dotted keys; absent in runs made before it (nothing fixed).
FIXED = "fixed_by_user"
#: config.json's entry of the choices a run's first start made from the hardware (train/plan/precision.py:
#: {"dtype", "muon_ns_dtype"}), which every --resume keeps. Not a setting: absent in runs made before it.
DECIDED = "decided"


def config_from_dict(data: dict[str, Any], origin: str) -> Config:
    """Rebuild a Config from its to_dict() form (config.json), with the same type checks as recipes."""
    if not isinstance(data, dict):  # a config.json holding a list or a number
        raise ConfigError(f"expected a JSON object of config sections, got {type(data).__name__}")
    legacy = legacy_model_table(data)  # a 2025 run's config.json from before the families (gpt2026)
    if legacy is not None:
        data = {**data, "model": legacy}
    elif isinstance(data.get("model"), dict) and "family" not in data["model"]:  # gpt2024, pre-split
        data = {**data, "model": legacy_gpt2024_table(data["model"])}
    cfg = Config()
    apply_table(cfg, {k: v for k, v in data.items() if k not in (RUN_ID, FIXED, DECIDED)}, origin)
    fixed = data.get(FIXED, [])
    if not isinstance(fixed, list) or not all(isinstance(k, str) for k in fixed):
        raise ConfigError(f"{origin}: {FIXED} must be a list of config keys, got {fixed!r}")
    cfg.fixed = frozenset(fixed)
    return cfg


def changed_keys(old: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every dotted key whose value differs."""
    a, b = flatten(old.to_dict()), flatten(new.to_dict())
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def check_resume(
    old: Config, new: Config, refuse: Callable[[str, Any, Any], SpeedrunError]
) -> list[tuple[str, Any, Any]]:
    """The resume rule: a run continues only with changes to RESUMABLE_CHANGES. Returns those changes;
    raises `refuse(key, before, after)` (the caller's message) for the first other one."""
    changes = changed_keys(old, new)
    # a checkpoint made before a time budget fixed the step count (train/plan/budget.py) continues under it:
    # no step before the fix depended on the count
    fixed = (
        old.train.time_budget_s > 0 and new.train.time_budget_s == 0 and new.train.steps <= old.train.steps
    )
    allowed = RESUMABLE_CHANGES + (("train.steps", "train.time_budget_s") if fixed else ())
    if refused := [change for change in changes if change[0] not in allowed]:
        raise refuse(*refused[0])
    return changes


def read_run_config(folder: Path, error: type[SpeedrunError] = ConfigError) -> Config:
    """The typed config a run or checkpoint folder saved (`config.json`), with the recipes' type checks;
    a missing, unreadable or invalid file is one `error` naming it. The one reader of config.json."""
    path = Path(folder) / "config.json"
    try:
        return config_from_dict(json.loads(read_regular(path).decode("utf-8")), str(path))
    except FileNotFoundError:
        raise error(f"{folder}: not a run directory (no config.json)") from None
    except (OSError, ValueError, ConfigError) as e:
        raise error(f"{path} is unusable ({e})") from None


def flatten(d: dict[str, Any], prefix: str = "", rows: bool = True) -> dict[str, Any]:
    """{dotted key: value} of a nested table, a part table's as `section.part.field` (`[model.mudd]`);
    `rows=False` keeps `optim.labels` whole, as a recipe states it (its rows are values, not keys)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and (rows or f"{prefix}{key}" != "optim.labels"):
            out.update(flatten(value, f"{prefix}{key}.", rows))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def read_toml(path: Path) -> dict[str, Any]:
    """A recipe file's table; any unreadable, non-UTF-8 or invalid file is one ConfigError line."""
    try:
        raw = Path(path).read_bytes()
        return tomllib.loads(raw.removeprefix(b"\xef\xbb\xbf").decode())  # a BOM: Windows editors add one
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
