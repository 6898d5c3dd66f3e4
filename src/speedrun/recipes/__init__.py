"""Named recipes: one TOML file per milestone of the record history, loaded into a typed Config; a file
may start from another with `base = "<name or path>"`, user files too."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from speedrun.config import Config
from speedrun.config.checks import validate
from speedrun.config.files import apply_table, parse_overrides, read_toml, table_keys
from speedrun.errors import ConfigError

DEFAULT_RECIPE = "demo"


def _recipe_dir() -> Path:
    return Path(str(resources.files("speedrun.recipes")))


def recipe_names() -> list[str]:
    """Names of the bundled recipes, sorted."""
    return sorted(p.stem for p in _recipe_dir().glob("*.toml"))


def _resolve(name_or_path: str) -> Path:
    """A bundled name wins over a same-named folder in the working directory (e.g. a run called demo)."""
    path = Path(name_or_path)
    bundled = _recipe_dir() / f"{name_or_path}.toml"
    looks_like_path = path.suffix == ".toml" or "/" in name_or_path
    if not looks_like_path and bundled.is_file():
        return bundled
    if path.is_file() or (looks_like_path and path.exists()):  # a folder: read_toml says what it is
        return path
    if looks_like_path:
        raise ConfigError(f"recipe file not found: {path}")
    raise ConfigError(f"unknown recipe '{name_or_path}' (known: {', '.join(recipe_names())})")


def _apply_file(cfg: Config, path: Path, seen: tuple[Path, ...]) -> None:
    """Apply the recipe file and its bases; the keys a file of the user's own sets (not a bundled one)
    join `cfg.fixed`, as an override does."""
    if path.resolve() in seen:
        raise ConfigError(f"recipe {path} inherits from itself")
    table = read_toml(path)
    table.pop(
        "provenance", None
    )  # facts about the recipe for `speedrun recipes` (recipes/index.py), no setting
    base = table.get("base")
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: base must be a recipe name or path, got {base!r}")
        base_path = _resolve(base) if not (path.parent / base).is_file() else path.parent / base
        _apply_file(cfg, base_path, (*seen, path.resolve()))
    apply_table(cfg, table, str(path))
    if path.resolve().parent != _recipe_dir().resolve():
        cfg.fixed |= table_keys(table)


def load_recipe(name_or_path: str = DEFAULT_RECIPE, overrides: list[str] | None = None) -> Config:
    """Build the resolved Config of a bundled recipe name or a TOML file, then apply key=value overrides."""
    path = _resolve(name_or_path)
    cfg = Config(recipe=path.stem)
    _apply_file(cfg, path, ())
    cfg.recipe = path.stem
    parse_overrides(cfg, overrides or [])
    t = cfg.train
    if t.time_budget_s == 0 and t.budget_min_steps > 0 and "train.budget_min_steps" not in cfg.fixed:
        t.budget_min_steps = 0  # the recipe's host fit serves its budget: `train.time_budget_s=0` ends both
    warmdown = {"train.warmdown_steps", "train.warmdown_frac"} & cfg.fixed  # a user's warm-down
    if warmdown == {"train.warmdown_steps"} and not t.stages:
        t.warmdown_frac = 0.0  # in steps (0 included: none) replaces the recipe's share (it would win)
    elif warmdown == {"train.warmdown_frac"} and t.warmdown_frac > 0:
        t.warmdown_steps = 0  # as a share replaces the recipe's steps
    validate(cfg)
    return cfg
