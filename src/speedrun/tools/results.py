"""A run folder as the research commands read it (`config.json`, `metrics.jsonl`, `summary.json`), from
files inside the folder only, so runs copied from other machines compare; and where a command may write
its report beside runs. compare, flops and alike import it; it imports none of them, nor torch
(running a run's model is tools/runs.py's)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from speedrun.atomic import TEMP_NAME_EXTRA, check_name_fits, check_replaceable, read_regular
from speedrun.config.files import config_from_dict, flatten
from speedrun.errors import ConfigError, DataError
from speedrun.printable import printable
from speedrun.train.run.rundir import RUN_FILES, read_records, saved_run_id


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


def read_json(path: Path) -> dict:
    """The JSON object in a run folder's file `path`; a DataError naming it if unreadable or no object."""
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
    raw = read_json(path / "config.json")
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
        summary = read_json(path / "summary.json")
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
        key = identity(run)
        if (first := kept.setdefault(key, run)) is run:
            continue
        keep, drop = (run, first) if _progress(run) > _progress(first) else (first, run)
        kept[key] = keep
        if drop.path.resolve() != keep.path.resolve():  # a copy, not the same folder named again
            how = f"run id {key}" if keep.run_id else "no run id; the same config.json and first step time"
            note(f"{drop.path} and {keep.path} are copies of one run ({how}): counted once, from the "
                 "latter")  # fmt: skip
    return list(kept.values())


def identity(run: Run) -> object:
    """What makes two folders one run: config.json's run id, else an old run's own marks, else its real
    path."""
    return run.run_id or _old_identity(run.path) or run.path.resolve()


def _old_identity(path: Path) -> str | None:
    """A run from before run ids, known by what a copy keeps and another run never repeats: its config.json
    and its first measured step time (metrics.jsonl's first record with a `time_s` above 0, a clock reading).
    None: nothing measured yet (its real path identifies it). Before, two copies of one old run counted as
    two repeats (issue 46)."""
    import hashlib
    import json

    try:
        config = (path / "config.json").read_bytes()
        with open(path / "metrics.jsonl", "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                t = record.get("time_s") if isinstance(record, dict) else None
                if isinstance(t, (int, float)) and t > 0:
                    return "old run " + hashlib.sha256(config + repr(t).encode()).hexdigest()[:16]
    except OSError:
        return None
    return None


def _progress(run: Run) -> tuple[int, int]:
    return {"stopped": 1, "finished": 2}.get(run.status, 0), run.steps or 0


def run_names(runs: list[Run]) -> list[str]:
    """Short unique names: the folder name, with its parent when names repeat (runs/a/seed1 ...); a
    byte that is not UTF-8 reads `\\xNN` (matplotlib refuses it in a legend)."""
    names = [printable(r.path.name) for r in runs]
    if len(set(names)) == len(names):
        return names
    return [printable(f"{r.path.parent.name}/{r.path.name}") for r in runs]


def fmt(value: float | None, spec: str, unit: str = "") -> str:
    """A table cell: `value` in `spec` (then `unit`), or "-" where it is unknown."""
    return "-" if value is None else format(value, spec) + unit


def columns(rows: list[tuple[str, ...]]) -> str:
    """Rows of cells (the header first) as left-aligned columns two spaces apart (compare, ablate)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
