"""The recipe index of `speedrun recipes` (and of the README's table, which a test keeps equal to it): one
line per bundled recipe from its `[provenance]` table and its resolved config, grouped by era; and the
short human summary of `speedrun recipes NAME`. Parameters are counted on the meta device (no memory,
no init), the one place the model's shapes are known; without torch the column says so."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from speedrun.config import Config
from speedrun.config.families import model_facts
from speedrun.config.files import read_toml
from speedrun.recipes import _recipe_dir, load_recipe, recipe_names

#: The eras, in the order the index shows them.
ERAS = (
    "2024: the gpt2024 family, one switch per technique (llm.c -> Sub3Min)",
    "2025-26: the gpt2026 family, per-layer compositions (record #26 -> #92)",
    "tracks 2 (GPT-2 Medium to 2.92) and 3 (fewest steps to 3.28)",
    "CPU demos: 150 s of training on any CPU (steps and tokens: at most)",
)
LEGEND = (
    "record: its number in its track's table in modded-nanogpt's README (t2, t3: tracks 2 and 3);",
    "time: the record's, on its hardware; params: the model's; tokens: steps x tokens a step",
)
#: The CPU-size counterpart of each family's records.
DEMO_OF = {"gpt2024": "demo-2025-01", "gpt2026": "demo-2026"}
_KEYS = {"date": str, "record": int, "track": int, "time": str, "hardware": str, "differs": str}


@dataclass(frozen=True)
class Entry:
    name: str
    family: str
    era: int  # index into ERAS
    date: str
    record: str
    time: str
    params: int | None
    steps: str
    tokens: str
    differs: str


def provenance(name: str) -> dict[str, str | int]:
    """The bundled recipe's `[provenance]` table (checked: bundled files are ours, a test reads them all)."""
    table = read_toml(_recipe_dir() / f"{name}.toml").get("provenance", {})
    for key, value in table.items():
        assert isinstance(value, _KEYS.get(key, type(None))), f"{name}: provenance.{key} = {value!r}"
    assert "differs" in table and "hardware" in table or "date" in table, f"{name}: provenance incomplete"
    return table


def param_count(cfg: Config) -> int | None:
    """The model's parameter count, built on the meta device; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    from speedrun.model.families import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg.model).parameters())


def _tokens(cfg: Config) -> int:
    """Tokens trained: the stages' batches over their steps, else steps x the global batch."""
    from speedrun.config.stages import stage_plan
    from speedrun.train.stages import stage_bounds

    plan = stage_plan(cfg)
    if plan is None:
        return cfg.train.steps * cfg.train.global_batch_tokens
    return sum(
        (end - start) * s.batch_tokens
        for s, (start, end) in zip(plan.stages, stage_bounds(plan), strict=True)
    )


def _short(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def entry(name: str) -> Entry:
    """One recipe's line of the index."""
    cfg, prov = load_recipe(name), provenance(name)
    track = prov.get("track", 1)
    if prov.get("hardware") == "CPU":
        era, record = 3, "-"
    else:
        era = 2 if track != 1 else model_facts(cfg.model).era
        record = ("" if track == 1 else f"t{track} ") + (f"#{prov['record']}" if "record" in prov else "base")
    budget = "<=" if cfg.train.time_budget_s > 0 else ""
    time = f"{prov['time']} {prov.get('hardware', '')}".strip() if "time" in prov else "-"
    if era == 3:
        time = f"{cfg.train.time_budget_s:.0f} s" if budget else "-"
    return Entry(
        name, cfg.model.family, era, str(prov.get("date", "-")), record, time, param_count(cfg),
        f"{budget}{cfg.train.steps:,}", budget + _short(_tokens(cfg)), str(prov["differs"]),
    )  # fmt: skip


def index_lines() -> list[str]:
    """`speedrun recipes`: a header, then each era's recipes by date, then the legend."""
    entries = [entry(n) for n in recipe_names()]
    width = max(len(e.name) for e in entries)
    row = f"{{:<{width}}}  {{:<7}}  {{:<10}}  {{:<7}}  {{:<16}}  {{:>7}}  {{:>7}}  {{:>7}}"
    lines = [row.format("recipe", "family", "date", "record", "time", "params", "steps", "tokens")]
    for era, title in enumerate(ERAS):
        lines.append(f"-- {title}")
        for e in sorted((e for e in entries if e.era == era), key=lambda e: (e.date, e.name)):
            params = "?" if e.params is None else _short(e.params)
            lines.append(row.format(e.name, e.family, e.date, e.record, e.time, params, e.steps, e.tokens))
    return [line.rstrip() for line in lines] + list(LEGEND)


def summary(name: str, columns: int = 100) -> str:
    """`speedrun recipes NAME`: provenance, what it adds over its base, what still differs from its
    script, and how to run it at demo size. The resolved config is `--json`'s."""
    e, cfg = entry(name), load_recipe(name)
    base = read_toml(_recipe_dir() / f"{name}.toml").get("base")
    wrap = textwrap.TextWrapper(width=max(60, columns), subsequent_indent="  ")
    params = "?" if e.params is None else f"{e.params:,}"
    what = (
        f"record {e.record} of {e.date}, {e.time}"
        if e.era < 3
        else "a CPU demo" + (f", time budget {e.time}" if e.time != "-" else "")
    )
    lines = [f"{name} ({e.family}): {what}"]
    lines += wrap.wrap(" ".join(cfg.description.split()))
    lines.append(f"size: {params} parameters, {e.steps} steps, {e.tokens} tokens")
    if isinstance(base, str):
        before, after = _flat(load_recipe(base).to_dict()), _flat(cfg.to_dict())
        changed = [k for k in after if k not in ("recipe", "description") and before.get(k) != after[k]]
        shown = ", ".join(changed[:10]) + (f" and {len(changed) - 10} more" if len(changed) > 10 else "")
        lines += wrap.wrap(f"adds over {base}: {len(changed)} settings: {shown}")
    if e.era == 3:
        lines += wrap.wrap(f"note: {e.differs}")
        lines.append(f"run it: speedrun train --recipe {name}")
    else:
        lines += wrap.wrap(f"still differs from its script: {e.differs} (docs/recipes.md)")
        demo = DEMO_OF[e.family] if e.era < 2 else "demo"
        lines.append(f"check it: speedrun train --recipe {name} --dry-run")
        lines += wrap.wrap(
            f"at demo size, on the CPU corpus: speedrun train --recipe {demo} (its family's parts)"
        )
        lines += wrap.wrap("at full size: speedrun prepare fineweb10B:9, then torchrun (docs/running.md)")
    lines.append(f"the resolved config: speedrun recipes {name} --json")
    return "\n".join(lines)


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "labels":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
