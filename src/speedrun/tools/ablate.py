"""`speedrun ablate`: what is each technique worth at this scale? The recipe (the baseline) and each
one-switch variant are trained for every seed, then one row per arm: the mean final val loss, its sd,
the difference to the baseline with Welch's two-sample t-test, tokens, training FLOPs and training time.

Each run goes into `OUT/<arm>-seed<S>-<hash>`, the hash being that of the run's resolved config, so
running the same ablation again reuses the runs that finished, resumes those that were stopped (a
checkpoint was saved), and trains only what is missing; a changed recipe or override trains anew.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from speedrun.config import Config
from speedrun.errors import ConfigError, DataError
from speedrun.tools.alike import DataHold, allowed_by, refuse_unlike, this_host
from speedrun.tools.seeds import parse_seed_count
from speedrun.train.signals import RunInterrupted

BASELINE = "baseline"
#: settings that change what a run writes (log lines, validation points, checkpoints, samples), never a
#: column of the table: a variant that differs from the baseline only in these trains the baseline again
REPORTING = (
    "description", "train.log_every", "train.val_every", "train.checkpoint_every", "train.checkpoint_at_end",
    "train.checkpoint_keep", "train.sample_every", "train.dist_timeout_s", "train.wandb_project",
)  # fmt: skip
#: what a time budget and the host fit choose (train/plan/budget.py, train/plan/host_fit.py): the
#: baseline's first run chooses them once and every other run takes its values, so an arm differs by
#: its switch alone
AUTOMATIC = (
    "train.steps", "train.time_budget_s", "train.budget_min_steps", "train.compile",
    "train.global_batch_tokens", "train.micro_batch_tokens", "model.n_embd",
)  # fmt: skip


@dataclass
class Arm:
    """The baseline or one variant: its label and one (config, run folder) per seed."""

    label: str
    switch: str | None
    runs: list[tuple[Config, Path]] = field(default_factory=list)

    @property
    def overrides(self) -> list[str]:
        return split_switch(self.switch) if self.switch is not None else []


def split_switch(switch: str) -> list[str]:
    """A switch's key=value settings: one, or several joined by `+` (`model.bigram_rows=0+model.
    bigram_sign_rows=0`), for a technique that is off only when two keys say so. A `+` splits only
    before a dotted key and `=`, so values such as 1e+3 stay whole."""
    return [part.strip() for part in re.split(r"\+(?=\s*[A-Za-z_]\w*\.[\w.]+\s*=)", switch)]


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:10]


def run_folder(out: Path, label: str, seed: int, cfg: Config) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._=+-]", "_", label)[:60]
    return out / f"{slug}-seed{seed}-{config_hash(cfg)}"


def plan(recipe: str, seeds: list[int], sets: list[str], switches: list[str], out: Path | None) -> list[Arm]:
    """Every arm's configs and folders, resolved before anything trains: an unknown key, a bad value, a
    switch that changes nothing or repeats, or a switch of the seed is a usage error here."""
    from speedrun.recipes import load_recipe

    for item in [*sets, *(part for s in switches for part in split_switch(s))]:
        if item.partition("=")[0].strip() == "train.seed":
            raise ConfigError("ablate sets train.seed from --seeds; drop the train.seed= override")
    keys = {s.partition("=")[0].strip() for s in sets}
    for switch in switches:
        _check_parts(switch)
        own = [part.partition("=")[0].strip() for part in split_switch(switch)]
        if switches.count(switch) > 1 or len(set(own)) < len(own) or keys & set(own):
            raise ConfigError(f"switch {switch}: given twice, or also set for all arms by --set")
    base = load_recipe(recipe, sets)
    out = out if out is not None else Path("runs") / f"ablate-{base.recipe}"
    arms = [Arm(BASELINE, None), *(Arm(s.strip(), s) for s in switches)]
    for arm in arms:
        variant = load_recipe(recipe, [*sets, *arm.overrides]) if arm.switch is not None else base
        if arm.switch is not None and variant.to_dict() == base.to_dict():
            raise ConfigError(
                f"switch {arm.switch} is the recipe's own value: the variant would be the baseline"
            )
        if arm.switch is not None and len(arm.overrides) > 1:
            _every_part_acts(arm.switch, arm.overrides, base, variant)
        if arm.switch is not None and (changed := _changed(base, variant)) and set(changed) <= set(REPORTING):
            raise ConfigError(
                f"switch {arm.switch} changes only what the runs report ({', '.join(changed)}), not "
                "their losses, tokens or training time: the variant would repeat the baseline"
            )
        for seed in seeds:
            cfg = load_recipe(recipe, [*sets, *arm.overrides, f"train.seed={seed}"])
            arm.runs.append((cfg, run_folder(out, arm.label, seed, cfg)))
    return arms


#: inside one part's value: a second setting joined by `,`, or by `+` but without its section (`+n_head=1`)
_JOINED = re.compile(r"[+,]\s*([A-Za-z_]\w*\.[\w.]+)\s*(?:=|$)|\+\s*([A-Za-z_]\w*)\s*=")


def _check_parts(switch: str) -> None:
    """A part whose value holds what reads as another setting was joined wrongly: refused naming the join
    that works, not left to the first key's type check (`expected an integer, got '2+n_head=1'`)."""
    for part in split_switch(switch):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"switch {switch}: part {part!r} is not key=value")
        if m := _JOINED.search(value):
            other = m.group(1) or m.group(2)
            raise ConfigError(
                f"switch {switch}: the value of {key.strip()} runs into {other!r}; join the settings of one "
                "switch with + and give each its section and value (model.n_layer=2+model.n_head=2)"
            )


def _every_part_acts(switch: str, parts: list[str], base: Config, variant: Config) -> None:
    """Each part of a `+` switch changes its key from the baseline's: a part that states the recipe's own
    value would label the arm with a change it does not make (issue 46)."""
    from speedrun.config import canonical_key
    from speedrun.config.files import flatten

    a, b = flatten(base.to_dict()), flatten(variant.to_dict())
    for part in parts:
        key = canonical_key(variant.model, part.partition("=")[0].strip())
        if key in b and a.get(key) == b[key]:
            raise ConfigError(
                f"switch {switch}: {part} is the recipe's own value ({key}={b[key]}), so the arm would be "
                "labelled with a change it does not make; drop that part"
            )


def _changed(base: Config, variant: Config) -> list[str]:
    from speedrun.config.files import flatten

    a, b = flatten(base.to_dict()), flatten(variant.to_dict())
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def is_arms_run(folder: Path, cfg: Config) -> bool:
    """Whether the run in `folder` was made from `cfg` (its config.json hashes as the folder's name says).
    A time budget or host fit writes what it resolved into config.json, so such a run is taken as is."""
    from speedrun.config.files import read_run_config

    if cfg.train.time_budget_s > 0 or cfg.train.budget_min_steps > 0:
        return True
    try:
        return config_hash(read_run_config(folder)) == config_hash(cfg)
    except ConfigError:
        return False


def state(folder: Path, cfg: Config) -> str:
    """The folder's state: "new" (nothing there, or a run that never reached step 0), "finished",
    "stopped" (resumable: from its checkpoint, or started over, as `train --resume` does, when it was
    killed before its first checkpoint), "other" (a finished or stopped run of another config: a copy, an
    edit) or "broken" (not ours)."""
    found = _found(folder)
    if found in ("finished", "stopped") and not is_arms_run(folder, cfg):
        return "other"
    return found


def _found(folder: Path) -> str:
    from speedrun.train.run.checkpoint import list_checkpoints
    from speedrun.train.run.rundir import SUMMARY_FILE, check_new

    if not folder.exists():
        return "new"
    summary = folder / SUMMARY_FILE
    if summary.is_file():
        try:
            status = json.loads(summary.read_text(encoding="utf-8")).get("status", "finished")
        except (OSError, ValueError, AttributeError):
            raise DataError(f"{summary}: unreadable; remove {folder} to train this run again") from None
        if status == "finished":
            return "finished"
    if (folder / "config.json").is_file() and list_checkpoints(folder):
        return "stopped"
    try:
        check_new(folder)
    except ConfigError:
        return "stopped" if (folder / "metrics.jsonl").is_file() else "broken"
    return "new"


def as_chosen_by(first: Path, cfg: Config, switch: str | None) -> Config:
    """`cfg` with the automatic choices the run in `first` made (AUTOMATIC), except the keys the arm's
    `switch` sets (the --set values were the first run's too: it kept them, or they set its budget)."""
    from speedrun.config.checks import validate
    from speedrun.config.files import flatten, read_run_config, set_value

    chosen, out = flatten(read_run_config(first, DataError).to_dict()), copy.deepcopy(cfg)
    own = {part.partition("=")[0].strip() for part in split_switch(switch)} if switch else set()
    for key in AUTOMATIC:
        if key not in own:
            set_value(out, key, chosen[key])
    validate(out)
    return out


def train_arms(arms: list[Arm], what: str = "ablation") -> None:
    """Train what is missing, one run after another; report what is reused or resumed. When the recipe
    chooses automatically (a time budget, a host fit), the baseline's first run chooses for all runs."""
    todo = [(arm, cfg, folder) for arm in arms for cfg, folder in arm.runs]
    states = {folder: state(folder, cfg) for _, cfg, folder in todo}  # all before the first run trains
    for folder, s in states.items():
        if s == "other":
            raise DataError(
                f"{folder} holds a run of another config (its config.json is not this arm's: copied or "
                "edited?); remove it to train this run again"
            )
        if s == "broken":
            raise DataError(
                f"{folder} holds neither a finished run nor a checkpoint to resume; remove it to train again"
            )
    first = todo[0][2]
    automatic = todo[0][1].train.time_budget_s > 0 or todo[0][1].train.budget_min_steps > 0
    allowed = allowed_by({part.partition("=")[0].strip() for arm in arms for part in arm.overrides})
    hold = DataHold()  # every run trains on the data the first one did, to the report
    try:
        for i, (arm, cfg, folder) in enumerate(todo, 1):
            here = this_host() | hold.check(cfg)
            refuse_unlike([f for _, _, f in todo], f"this {what}", here, allowed)
            _train_one(arm, cfg, folder, f"{arm.label}, seed {cfg.train.seed} ({i}/{len(todo)}): {folder}",
                       states[folder], first if automatic and i > 1 else None, i == 2)  # fmt: skip
    except RunInterrupted as e:  # the remedy is this command again, not one run's `train --resume` (issue 46)
        stop = str(e).partition("; resume with:")[0]
        raise RunInterrupted(
            f"{stop}; run the same {what} command again to go on (finished runs are reused, this one "
            "resumes)",
            e.exit_code - 128,
        ) from None
    finally:
        hold.close()
    refuse_unlike([f for _, _, f in todo], f"this {what}", allowed=allowed)


def _train_one(
    arm: Arm, cfg: Config, folder: Path, tag: str, found: str, first: Path | None, say: bool
) -> None:
    """Train, resume or reuse one run; `first`: the run whose automatic choices every later run takes."""
    from speedrun.config.files import read_run_config
    from speedrun.train.loop import train
    from speedrun.train.run.checkpoint import list_checkpoints

    if first is not None:
        cfg = as_chosen_by(first, cfg, arm.switch)
        if say:
            print(f"=== every run takes the steps ({cfg.train.steps}) and sizes that the time budget "
                  f"and host fit chose for the first: {first}/config.json ===", flush=True)  # fmt: skip
    if found == "finished":
        print(f"=== {tag}: finished before, reused ===", flush=True)
        return
    from speedrun.tools import compile_cache

    cache = compile_cache.measure(compile_cache.cache_folder())  # what the run finds when it starts
    if found == "stopped":
        how = "resumed from its checkpoint" if list_checkpoints(folder) else "started over"
        print(f"=== {tag}: {how} ===", flush=True)
        train(read_run_config(folder, DataError), folder, resume=True)
    else:
        print(f"=== {tag} ===", flush=True)
        train(cfg, folder)
    compile_cache.record(folder, cache)


@dataclass
class Row:
    label: str
    n: int
    mean: float | None
    sd: float | None
    diff: float | None  # mean - the baseline's mean
    p: float | None  # Welch's two-sided p against the baseline
    tokens: float | None  # mean tokens trained per run
    train_time_s: float | None
    flops: float | None = None  # mean training FLOPs per run (tools/flops.py)


def results(arms: list[Arm]) -> list[Row]:
    """One row per arm from its runs' files (compare's reader; only finished runs count)."""
    from speedrun.tools.compare import Group
    from speedrun.tools.flops import train_flops
    from speedrun.tools.results import load_run
    from speedrun.tools.stats import mean_sd, welch_test

    groups = [Group(arm.label, [load_run(folder) for _, folder in arm.runs]) for arm in arms]
    base = groups[0].losses
    base_mean = mean_sd(base)[0]
    rows = []
    for g in groups:
        done = [r for r in g.runs if r.finished]
        mean, sd = mean_sd(g.losses)
        test = welch_test(g.losses, base, "ablate") if g is not groups[0] else None
        rows.append(
            Row(
                g.label,
                g.n,
                mean,
                sd,
                mean - base_mean if g is not groups[0] and None not in (mean, base_mean) else None,
                test[1] if test else None,
                mean_sd([r.curve[-1][0] for r in done if r.curve])[0],  # stage-aware: the loop's count
                mean_sd([r.train_time_s for r in done if r.train_time_s is not None])[0],
            )
        )
        rows[-1].flops = mean_sd([f for r in done if (f := train_flops(r)) is not None])[0]
    return rows


def format_rows(rows: list[Row]) -> str:
    from speedrun.tools.flops import format_flops
    from speedrun.tools.results import columns, fmt

    header = ("arm", "n", "val loss", "sd", "vs baseline", "p (Welch)", "tokens", "FLOPs", "train time")
    cells = [
        (
            r.label,
            str(r.n),
            fmt(r.mean, ".4f"),
            fmt(r.sd, ".4f"),
            fmt(r.diff, "+.4f"),
            fmt(r.p, ".3g"),
            fmt(r.tokens, ",.0f"),
            format_flops(r.flops),
            fmt(r.train_time_s, ".1f", "s"),
        )
        for r in rows
    ]
    return columns([header, *cells])


def cmd_ablate(args: argparse.Namespace) -> int:
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a file, not a folder")
    seeds = parse_seed_count(args.seeds)
    arms = plan(args.recipe, seeds, args.set, args.switches, args.out)
    train_arms(arms)
    out = arms[0].runs[0][1].parent
    print(f"ablation of {arms[0].runs[0][0].recipe}, seeds {', '.join(map(str, seeds))} (runs in {out}):")
    print(format_rows(results(arms)))
    return 0
