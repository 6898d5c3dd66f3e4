"""The one rule for "alike" (DESIGN 16): runs set side by side (race, ablate, noise, compare, verify) must
share what each run folder records of its data (meta.json's source and fingerprint), tokenizer, hardware,
thread count, precision and code, every start of a run included; a difference other than the switch
under test is refused or flagged. A fact a folder does not record (an older run) is not compared, except
the data: a run without the content's fingerprint is compared by meta.json's source."""

from __future__ import annotations

import re
from pathlib import Path

from speedrun.atomic import json_object
from speedrun.data.meta import DATA_FINGERPRINT
from speedrun.errors import DataError
from speedrun.printable import printable
from speedrun.tools.run_facts import parse_log, recorded_hardware

FACTS = ("data", "data content", "tokenizer", "hardware", "threads", "precision", "code")
#: the facts that change a run's losses, not only its speed: compare's groups split on them
LOSS_FACTS = ("data", "data content", "tokenizer", "precision")
#: the facts that change only how fast a run is (and the code, which a group's runs may share by config
#: alone): compare flags them under a group
SPEED_FACTS = ("hardware", "threads", "code")
_THREADS = re.compile(r"^cpu: .*torch threads (\d+)\s*$")
_PRECISION = re.compile(r"^precision (\w+) \(")
_DATA = re.compile(r"^data: .*" + re.escape(DATA_FINGERPRINT) + r"([0-9a-f]+)\)\s*$")

Setting = dict[str, "str | None"]


def _joined(values: list[str]) -> str | None:
    """Each start's value; a run whose starts differ reads `A, then B` (never alike another run)."""
    distinct = list(dict.fromkeys(values))
    return ", then ".join(distinct) if distinct else None


def setting(path: Path) -> Setting:
    """What the run folder `path` records of each fact (None: not recorded there)."""
    path = Path(path)
    try:
        text = (path / "log.txt").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    lines = text.splitlines()
    summary, data = json_object(path / "summary.json"), json_object(path / "config.json").get("data")
    tokenizer = data.get("tokenizer") if isinstance(data, dict) else None
    source = summary.get("data_source")
    prints = [m.group(1) for line in lines if (m := _DATA.match(line))]
    dtype = (
        (summary.get("precision") or {}).get("dtype") if isinstance(summary.get("precision"), dict) else None
    )
    precisions = [m.group(1) for line in lines if (m := _PRECISION.match(line))] or ([dtype] if dtype else [])
    codes = [c if d is None else f"{c}, diff {d[:12]}" for c, d in parse_log(text)[0]]
    hardware = [h for h in recorded_hardware(path) if h != "unrecorded hardware"] if summary else []
    return {
        # meta.json's source (summary.json): compared where a run lacks the content's fingerprint (one from
        # before it), so an old run is compared with a new one by source, not taken as alike (issue 46)
        "data": source if isinstance(source, str) else None,
        "data content": _joined([f"meta.json {p}" for p in prints]),  # each start's fingerprint (log.txt)
        "tokenizer": tokenizer if isinstance(tokenizer, str) else None,
        "hardware": _joined(hardware),
        "threads": _joined([m.group(1) for line in lines if (m := _THREADS.match(line))]),
        "precision": _joined([str(p) for p in precisions]),
        "code": _joined(codes),
    }


def differences(settings: dict[str, Setting], facts: tuple[str, ...] = FACTS) -> list[str]:
    """One text per fact on which the named settings differ (unrecorded values skipped), naming the first
    holder of each value: `threads: 2 (runs/A-pair1); 1 (runs/B-pair1)`."""
    found = []
    for fact in facts:
        if fact == "data" and all(v.get("data content") for v in settings.values() if v.get("data")):
            continue  # every run knows its data's content: the fingerprints decide (a source names a path)
        holders: dict[str, str] = {}
        for name, values in settings.items():
            if values.get(fact) is not None:
                holders.setdefault(values[fact], name)
        if len(holders) > 1 or any(", then " in v for v in holders):
            found.append(f"{fact}: " + "; ".join(f"{printable(v)} ({h})" for v, h in holders.items()))
    return found


def refuse_unlike(
    paths: list[Path], what: str, here: Setting | None = None, allowed: tuple[str, ...] = ()
) -> None:
    """A DataError in one line when the runs in `paths` (and `here`, a run started now) are not alike in
    a fact other than `allowed` (what the comparison's switch changes)."""
    settings = {"this host": here} if here is not None else {}
    settings |= {str(p): setting(p) for p in paths if (Path(p) / "config.json").is_file()}
    found = differences(settings, tuple(f for f in FACTS if f not in allowed))
    if found:
        raise DataError(
            f"refused: {what}'s runs are not alike ({found[0]}"
            + (f"; and {len(found) - 1} more fact(s)" if len(found) > 1 else "")
            + "); compare like with like: train them again alike, in a new --out"
        )


def this_host() -> Setting:
    """The facts a run started now by this process's environment would record about threads."""
    import torch

    return {"threads": str(torch.get_num_threads())}


def allowed_by(keys: set[str]) -> tuple[str, ...]:
    """The facts a switch of these config keys changes on purpose: a data or tokenizer switch the data,
    a train.dtype switch the precision."""
    allowed = []
    if any(k.startswith("data.") for k in keys):
        allowed += ["data", "data content", "tokenizer"]
    if "train.dtype" in keys:
        allowed.append("precision")
    return tuple(allowed)


class DataHold:
    """The data folders of a race, ablation or noise study, held for its whole duration: the shared lock
    every training run takes (data/folder_lock.py, which `prepare` respects) stays taken between runs, and
    each folder's meta.json fingerprint is checked before every run (where `flock` does nothing)."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}
        self.prints: dict[Path, str] = {}

    def check(self, cfg) -> Setting:
        """Hold the data folder of `cfg` (from its first run on, once it exists) and return what a run of it
        started now records of its data; a DataError when the folder changed since the first check."""
        from speedrun.data.folder_lock import hold_for_training
        from speedrun.data.meta import META_FILE, data_dir_for, meta_fingerprint

        folder = data_dir_for(cfg).resolve()
        if folder not in self.fds and (fd := hold_for_training(folder)) is not None:
            self.fds[folder] = fd
        meta = json_object(folder / META_FILE)
        if not meta:
            return {}  # not prepared yet (the first run prepares it) or damaged (the run says why)
        now = meta_fingerprint(meta)
        if self.prints.setdefault(folder, now) != now:
            raise DataError(
                f"refused: the data folder {folder} was prepared again during this comparison (meta.json "
                f"fingerprint {self.prints[folder]}, now {now}); its runs would train on different corpora"
            )
        return {"data content": f"meta.json {now}"}

    def close(self) -> None:
        import os

        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def verify_alike(paths: list[Path], baseline: list) -> tuple[str, str]:
    """verify's rule for the facts its other rules leave here: one data folder content (meta.json's
    fingerprint), precision and thread count in every start of every run, and the baseline's threads."""
    mine = {Path(p).name: setting(p) for p in paths}
    found = differences(mine, ("data", "data content", "precision", "threads"))
    found += differences(mine | {f"baseline {r.path}": setting(r.path) for r in baseline}, ("threads",))
    if found:
        return "fails", f"runs not alike: {found[0]}"
    return "ok", "one data content, precision and thread count in all runs (as recorded)"
