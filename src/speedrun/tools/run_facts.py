"""What `speedrun verify` reads from a run folder beyond compare's Run: per start, the code, inductor
settings and warm-ups (log.txt), and its step, hardware and timing warm-up with the steps timed over all
starts (summary.json's `starts` and `timed_steps`, carried in the checkpoints: train/timing.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from speedrun.errors import DataError
from speedrun.tools.results import Run, read_json, run_names
from speedrun.train.run.environment import DIFF_END, DIFF_START
from speedrun.train.run.rundir import SUMMARY_FILE

WARMUP = "timing_warmup_steps"


@dataclass
class Start:
    """One start of a run (the first, or a --resume) whose steps the run kept: summary.json's `starts`."""

    step: int  # the step it began at
    hardware: str | None  # "8 x NVIDIA H100 80GB HBM3"; None: not recorded
    untimed: int | None  # its train.timing_warmup_steps; None: not recorded


@dataclass
class Facts:
    """What the rules read from one run folder beyond compare's Run."""

    run: Run
    name: str
    codes: list[tuple[str, str | None]] | None  # (code line, sha256 of its diff) per start; None: no log
    inductor: list[str | None]  # the `inductor env:` value of each start (None: not recorded)
    warmups: list[str]  # the warm-up lines
    starts: list[Start] | None  # every start of the run; None: a resumed run from before they were kept
    timed_steps: int | None  # steps the clock timed over all starts (summary.json); None: not recorded
    data_source: str | None  # the data folder's meta.json source (summary.json); None: not recorded
    timed_through: int | None = None  # the last step inside the clock; None: not recorded
    extension_steps: int = 0  # the stages' extension steps (#344 times them); 0 also when not recorded
    eval_writes: int | None = None  # validations that wrote a weight or a gradient; None: not recorded


def parse_log(text: str) -> tuple[list[tuple[str, str | None]], list[str | None], list[str]]:
    """(code versions, inductor environments, warm-up lines) of a log.txt. Each start of the run (the
    first and every --resume) writes an environment report beginning with its `code:` line."""
    lines = text.splitlines()
    codes: list[tuple[str, str | None]] = []
    inductor: list[str | None] = []
    warmups = [line for line in lines if line.startswith("warm-up:")]
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("code: "):
            diff = None
            if lines[i + 1 : i + 2] == [DIFF_START]:
                rest = lines[i + 2 :]
                end = rest.index(DIFF_END) if DIFF_END in rest else len(rest)
                diff = hashlib.sha256("\n".join(rest[:end]).encode()).hexdigest()
                i += 2 + end
            codes.append((line.removeprefix("code: ").strip(), diff))
            inductor.append(None)
        elif line.startswith("inductor env: ") and inductor:
            inductor[-1] = line.removeprefix("inductor env: ").strip()
        i += 1
    return codes, inductor, warmups


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _hardware(world: object, name: object) -> str | None:
    return f"{world} x {name}" if _int(world) is not None and isinstance(name, str) else None


def _recorded(run: Run, log_starts: int) -> tuple:
    """(starts, timed steps, data source, timed through, extension steps, eval writes) from summary.json;
    an older folder gets starts only when its log shows one start, and a run without summary.json only
    its config's facts."""
    path = run.path
    summary = read_json(path / SUMMARY_FILE) if (path / SUMMARY_FILE).is_file() else {}
    source = summary.get("data_source")
    if source is not None and not isinstance(source, str):
        raise DataError(f"{path / SUMMARY_FILE}: data_source must be a string")
    listed = summary.get("starts")
    if listed is not None:
        entries = listed if isinstance(listed, list) else []
        if not entries or not all(isinstance(s, dict) and _int(s.get("step")) is not None for s in entries):
            raise DataError(f"{path / SUMMARY_FILE}: starts must be a list of objects with an integer step")
        starts = [
            Start(s["step"], _hardware(s.get("world_size"), s.get("device_name")), _int(s.get(WARMUP)))
            for s in listed
        ]
        steps = [s.step for s in starts]  # each start resumes from a later checkpoint (train/timing.py)
        if steps[0] != 0 or steps != sorted(set(steps)) or any((s.untimed or 0) < 0 for s in starts):
            raise DataError(
                f"{path / SUMMARY_FILE}: starts must begin at step 0, at increasing steps, with "
                f"{WARMUP} >= 0 (edited?)"
            )
    elif log_starts <= 1:
        grace = _int(run.config.get("train.timing_warmup_steps"))
        starts = [Start(0, _hardware(summary.get("world_size"), summary.get("device_name")), grace)]
    else:
        starts = None
    counts = {k: summary.get(k) for k in ("timed_through", "extension_steps", "eval_writes")}
    if any(v is not None and (_int(v) is None or v < 0) for v in counts.values()):
        raise DataError(f"{path / SUMMARY_FILE}: {', '.join(counts)} must be integers >= 0 (edited?)")
    timed = summary.get("timed_steps")
    if timed is not None and (_int(timed) is None or timed < 0):
        raise DataError(f"{path / SUMMARY_FILE}: timed_steps must be an integer >= 0 (edited?)")
    steps, planned = run.steps, _int(run.config.get("train.steps"))
    bounds = {
        "timed_steps": timed,
        "timed_through": counts["timed_through"],
        "starts": starts and starts[-1].step,
    }
    bounds |= {"extension_steps": counts["extension_steps"]}
    for key, value in bounds.items():  # counts that cannot exceed the steps the run trained
        if value is not None and steps is not None and value > steps:
            raise DataError(f"{path / SUMMARY_FILE}: {key} {value} exceeds the run's {steps} steps (edited?)")
    if steps is not None and planned is not None and steps > planned:
        raise DataError(
            f"{path}: {steps} steps trained, more than its config's train.steps={planned} (edited?)"
        )
    late = (counts["timed_through"], counts["extension_steps"] or 0, counts["eval_writes"])
    return starts, timed, source, *late


def recorded_hardware(path: Path) -> list[str]:
    """Every hardware kind a finished or stopped run folder's summary.json records: its device line and
    each start's (a run resumed elsewhere has several); "unrecorded hardware" where one is missing."""
    summary = read_json(path / SUMMARY_FILE)
    listed = summary.get("starts")
    pairs = [(summary.get("world_size"), summary.get("device_name"))]  # the last start's, as summary says
    if isinstance(listed, list):
        pairs += [(s.get("world_size"), s.get("device_name")) for s in listed if isinstance(s, dict)]
    return list(dict.fromkeys(_hardware(world, name) or "unrecorded hardware" for world, name in pairs))


def read_facts(runs: list[Run]) -> list[Facts]:
    facts = []
    for name, run in zip(run_names(runs), runs, strict=True):
        log = run.path / "log.txt"
        try:
            text = log.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            text = None
        except OSError as e:
            raise DataError(f"cannot read {log}: {e.strerror or e}") from None
        codes, inductor, warmups = parse_log(text) if text is not None else (None, [], [])
        facts.append(Facts(run, name, codes, inductor, warmups, *_recorded(run, len(codes or []))))
    return facts
