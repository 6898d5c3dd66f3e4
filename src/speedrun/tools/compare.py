"""`speedrun compare`: a table of runs, curves, and the record rules' statistical test.

Everything comes from files inside each run directory (`config.json`, `metrics.jsonl`, and
`summary.json` when present), never from absolute paths, so runs copied from other machines compare.
Runs whose configs are equal except for the seed and settings that only observe a run (logging,
validation and checkpoint cadence, device, compile, data folder location) form a group: the record
rules ask whether the group's mean final val loss is below the target, by a one-sided t-test.
"""

from __future__ import annotations

import importlib
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from speedrun.atomic import TEMP_NAME_EXTRA, check_name_fits, check_replaceable, read_regular, write_atomic
from speedrun.config_files import FIXED, RESUMABLE_CHANGES, RUN_ID, config_from_dict, flatten
from speedrun.errors import ConfigError, DataError, SpeedrunError
from speedrun.printable import printable
from speedrun.train.rundir import RUN_FILES, read_records, saved_run_id

#: Keys that may differ inside a group of repeats.
NOT_COMPARED = ("train.seed", "data.dir", RUN_ID, FIXED, *RESUMABLE_CHANGES)


@dataclass
class Run:
    """What compare needs from one run directory."""

    path: Path
    recipe: str
    config: dict
    steps: int | None = None
    train_time_s: float | None = None
    tokens_per_s: float | None = None
    final_val_loss: float | None = None
    final_val_bpb: float | None = None
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (tokens, time_s, val_loss)
    status: str = "unfinished"  # summary.json's "finished" | "stopped"; no summary: killed or still running
    run_id: str | None = None  # config.json's identity of the run (config.RUN_ID); None before run ids
    tokens: int | None = None  # tokens trained (the last training record's)
    flops_per_token: int | None = None  # an old summary.json's count at the last window (before train_flops)
    train_flops: float | None = None  # summary.json's: Σ tokens × each step's count (tools/flops.py)

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    @property
    def seed(self) -> int | None:
        return self.config.get("train.seed")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(read_regular(path).decode("utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object")
    return data


def _number(value: object, where: str, key: str, integer: bool = False) -> float | int | None:
    """A number read from a run's file, or None when absent; anything else is a DataError naming it
    (a string or a list would otherwise crash the arithmetic or the table far from the file)."""
    if value is None:
        return None
    wrong_kind = integer and not isinstance(value, int)
    if isinstance(value, bool) or not isinstance(value, int | float) or wrong_kind:
        kind = "an integer" if integer else "a number"
        raise DataError(f"{where}: {key} must be {kind}, got {value!r}")
    return value


def _records(path: Path) -> list[dict]:
    """The metrics records (the same reader as --resume: a torn last line from a kill is skipped,
    any other bad line is a DataError), with their numeric fields checked."""
    records, _torn = read_records(path)
    for n, (_, r) in enumerate(records, 1):
        for key in ("train_loss", "val_loss", "val_bpb", "tokens", "time_s"):
            _number(r.get(key), f"{path}:{n}", key, integer=key == "tokens")
    return [r for _, r in records]


def load_run(path: Path) -> Run:
    """Read one run directory; DataError when it is not one."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "metrics.jsonl").is_file():
        raise DataError(f"{path}: not a run directory (needs config.json and metrics.jsonl)")
    raw = _read_json(path / "config.json")
    try:  # through the typed config, so fields added since the run compare as their defaults
        config = flatten(config_from_dict(raw, str(path / "config.json")).to_dict())
    except ConfigError:  # a run from a newer version with keys this one does not know: compare as written
        config = flatten(raw)
        _number(config.get("train.seed"), str(path / "config.json"), "train.seed", integer=True)
    records = _records(path / "metrics.jsonl")
    run = Run(path, str(config.get("recipe", "?")), config, run_id=saved_run_id(path))
    train = [r for r in records if "train_loss" in r]
    val = [r for r in records if r.get("val_loss") is not None]
    run.curve = [(int(r.get("tokens", 0)), float(r.get("time_s", 0.0)), float(r["val_loss"])) for r in val]
    if train:
        last = train[-1]
        run.steps, run.train_time_s = int(last["step"]), float(last.get("time_s", 0.0))
        run.tokens = last.get("tokens")
        where = f"{path / 'config.json'}"
        warmup = _number(config.get("train.timing_warmup_steps"), where, "train.timing_warmup_steps", True)
        batch = _number(config.get("train.global_batch_tokens"), where, "train.global_batch_tokens", True)
        timed_steps = last["step"] - (warmup or 0)
        if run.train_time_s > 0 and timed_steps > 0 and batch:
            run.tokens_per_s = timed_steps * batch / run.train_time_s
    if val:
        run.final_val_loss, run.final_val_bpb = float(val[-1]["val_loss"]), val[-1].get("val_bpb")
    if (path / "summary.json").is_file():  # the loop's own numbers, when it wrote them
        summary = _read_json(path / "summary.json")
        run.status = str(summary.get("status", "finished"))  # summaries before the field: finished runs
        for key in (
            "steps",
            "train_time_s",
            "tokens_per_s",
            "final_val_loss",
            "final_val_bpb",
            "flops_per_token",
            "train_flops",
        ):
            integer = key in ("steps", "flops_per_token")
            value = _number(summary.get(key), str(path / "summary.json"), key, integer=integer)
            if value is not None:
                setattr(run, key, value)
    return run


def check_report(path: Path, flag: str) -> None:
    """Where a command writes its report (`verify --json`, `compare --plot`, `bench --json`), checked
    before any work: a regular file or nothing (atomic.check_replaceable), and never a run's own file
    (config.json, metrics.jsonl, log.txt, summary.json, the lock, event files, checkpoints) or a data
    folder's (meta.json, tokenizer.json, shards), present or not: `verify RUN --json RUN/summary.json`
    replaced the run's result with the report, `--json DATA/meta.json` the data folder's description."""
    from speedrun.data.meta import is_data_file_name, is_prepared_folder

    check_name_fits(path, flag, TEMP_NAME_EXTRA)  # written as .NAME.XXXXXXXX.tmp, then renamed
    check_replaceable(path)
    path = Path(path)
    target = path.parent.resolve() / path.name
    for folder in target.parents:
        first = target.relative_to(folder).parts[0]
        if (folder / "config.json").is_file() and (folder / "metrics.jsonl").is_file():
            if first in RUN_FILES or first.startswith("events.out.tfevents."):
                raise ConfigError(f"{flag} {path}: is the run {folder}'s own {first}; choose another name")
            return
        if is_data_file_name(first) and is_prepared_folder(folder):
            raise ConfigError(f"{flag} {path}: is the data folder {folder}'s {first}; choose another name")


def load_runs(paths: list[Path], note: Callable[[str], object] = print) -> list[Run]:
    """Each run once, not as two repeats (which would halve the t-test's p-value on no new evidence): a
    run is known by the identity config.json got when it was created, which a copy of the folder keeps,
    or, for a run from before run ids, by its real path (the same folder by a link or another relative
    path). Of copies, the one furthest along is kept (finished, stopped, unfinished; then more steps;
    then the first given), and `note` says which."""
    kept: dict[object, Run] = {}
    for path in paths:
        run = load_run(path)
        key = run.run_id or Path(path).resolve()
        if (first := kept.setdefault(key, run)) is run:
            continue
        keep, drop = (run, first) if _progress(run) > _progress(first) else (first, run)
        kept[key] = keep
        if drop.path.resolve() != keep.path.resolve():  # a copy, not the same folder named again
            note(f"{drop.path} and {keep.path} are copies of one run (run id {key}): counted once, from the "
                 "latter")  # fmt: skip
    return list(kept.values())


def _progress(run: Run) -> tuple[int, int]:
    return {"stopped": 1, "finished": 2}.get(run.status, 0), run.steps or 0


def group_key(run: Run) -> tuple:
    return tuple(sorted((k, json.dumps(v)) for k, v in run.config.items() if k not in NOT_COMPARED))


@dataclass
class Group:
    label: str
    runs: list[Run]
    mean: float | None = None
    std: float | None = None
    t: float | None = None
    p: float | None = None

    @property
    def n(self) -> int:
        return len(self.losses)

    @property
    def losses(self) -> list[float]:
        """Final val losses of the runs that finished: a stopped or killed run's last loss is not a result."""
        return [r.final_val_loss for r in self.runs if r.finished and r.final_val_loss is not None]

    @property
    def unfinished(self) -> int:
        return sum(not r.finished for r in self.runs)


def research_module(name: str, command: str) -> ModuleType:
    """Import a package of the `research` extra, or say in one line which command needs it and how to
    install it (they are not in the base install)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        package = name.split(".")[0]
        raise SpeedrunError(
            f"`speedrun {command}` needs {package}: pip install 'speedrun[research]'"
        ) from None


def below_target_test(losses: list[float], target: float) -> tuple[float, float]:
    """(t, p) of the one-sided one-sample t-test H1: mean < target (scipy.stats.ttest_1samp)."""
    import warnings

    stats = research_module("scipy.stats", "compare")
    with warnings.catch_warnings():  # equal losses: scipy warns of precision loss and returns nan
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_1samp(losses, target, alternative="less")
    return float(result.statistic), float(result.pvalue)


def make_groups(runs: list[Run], target: float) -> list[Group]:
    """Runs grouped by config (seed and observation settings ignored), with mean, std, n, t-test."""
    from speedrun.tools.alike import LOSS_FACTS, setting

    facts = {id(run): setting(run.path) for run in runs}  # runs on other data or in another precision are
    known = [
        k for k in LOSS_FACTS if all(f[k] is not None for f in facts.values())
    ]  # another group (alike.py)
    by_key: dict[tuple, list[Run]] = {}
    for run in runs:  # a fact some run does not record (an older run) cannot set runs apart
        alike = tuple((f"run {k}", json.dumps(facts[id(run)][k])) for k in known)
        by_key.setdefault(group_key(run) + alike, []).append(run)
    groups = []
    for members in by_key.values():
        same_recipe = [k for k in by_key if dict(k).get("recipe") == json.dumps(members[0].recipe)]
        label = members[0].recipe
        if len(same_recipe) > 1:  # name the settings that set this group apart from its namesakes
            mine = dict(next(k for k, v in by_key.items() if v is members))
            others = [dict(k) for k in same_recipe if dict(k) != mine]
            diff = sorted({k for o in others for k in set(mine) | set(o) if mine.get(k) != o.get(k)})
            label += " [" + ", ".join(f"{k}={json.loads(mine[k]) if k in mine else '-'}" for k in diff) + "]"
        g = Group(label, members)
        losses = g.losses
        if losses:
            g.mean = sum(losses) / len(losses)
        if len(losses) >= 2:
            g.std = math.sqrt(sum((x - g.mean) ** 2 for x in losses) / (len(losses) - 1))
            g.t, g.p = below_target_test(losses, target)
        groups.append(g)
    return groups


def run_names(runs: list[Run]) -> list[str]:
    """Short unique names: the folder name, with its parent when names repeat (runs/a/seed1 ...); a
    byte that is not UTF-8 reads `\\xNN` (matplotlib refuses it in a legend)."""
    names = [printable(r.path.name) for r in runs]
    if len(set(names)) == len(names):
        return names
    return [printable(f"{r.path.parent.name}/{r.path.name}") for r in runs]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(runs: list[Run], groups: list[Group], target: float) -> str:
    """The runs table (with the FLOPs axis: training FLOPs, tokens to reach the target), then one line
    per group with its statistics."""
    from speedrun.tools.flops import format_flops, tokens_to_target, train_flops

    names = run_names(runs)
    header = ("run", "recipe", "seed", "steps", "train time", "tokens/s", "val loss", "val bpb", "FLOPs")
    header += (f"tokens to {target:g}",)
    rows = [
        (
            name if r.finished else f"{name} ({r.status})",
            r.recipe,
            _fmt(r.seed, "d"),
            _fmt(r.steps, "d"),
            _fmt(r.train_time_s, ".1f") + ("s" if r.train_time_s is not None else ""),
            _fmt(r.tokens_per_s, ",.0f"),
            _fmt(r.final_val_loss, ".4f"),
            _fmt(r.final_val_bpb, ".4f"),
            format_flops(train_flops(r)),
            _fmt(tokens_to_target(r, target), ",d"),
        )
        for name, r in zip(names, runs, strict=True)
    ]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    lines.append("")
    from speedrun.tools.alike import SPEED_FACTS, differences, setting

    for g in groups:
        for text in differences({str(r.path): setting(r.path) for r in g.runs}, SPEED_FACTS):
            lines.append(f"note: group {g.label}'s runs differ in {text}: their times do not compare")
        stats = f"n={g.n}  mean {_fmt(g.mean, '.4f')}  std {_fmt(g.std, '.4f')}"
        if g.p is not None:
            verdict = "below" if g.p < 0.01 else "not shown below"
            stats += f"  t={g.t:.3f}  p={g.p:.3g} (mean < {target}: {verdict} at p<0.01)"
        else:
            stats += "  (t-test needs >= 2 finished runs with a final val loss)"
        if g.unfinished:
            stats += f"  ({g.unfinished} unfinished run(s) left out)"
        lines.append(f"group {g.label}: {stats}")
    return "\n".join(lines)


def plot_runs(runs: list[Run], out: Path, target: float | None = None, x: str = "tokens") -> Path:
    """PNG with val loss against tokens (or training FLOPs: `x="flops"`, which compares runs across
    hardware) and against training time, one line per run (written atomically)."""
    from speedrun.tools.flops import flops_per_token

    scale = {id(r): 1 if x == "tokens" else flops_per_token(r) for r in runs}
    unknown = [r.path for r in runs if scale[id(r)] is None]
    if unknown:
        raise DataError(f"{unknown[0]}: FLOPs per token unknown (a config.json this version cannot read)")
    research_module("matplotlib", "compare --plot").use("Agg")
    plt = research_module("matplotlib.pyplot", "compare --plot")

    fig, (ax_tok, ax_time) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80)
    for name, run in zip(run_names(runs), runs, strict=True):
        if not run.curve:
            continue
        tokens, times, losses = zip(*run.curve, strict=True)
        ax_tok.plot([t * scale[id(run)] for t in tokens], losses, marker=".", label=name)
        ax_time.plot(times, losses, marker=".", label=name)
    first = "tokens" if x == "tokens" else "training FLOPs"
    for ax, xlabel in ((ax_tok, first), (ax_time, "training time (s)")):
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss")
        ax.grid(alpha=0.3)
    ax_tok.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    write_atomic(Path(out), buf.getvalue())
    return Path(out)
