"""Cold or warm compile cache: the one rule for what a timed run found in inductor's cache folder when it
started, for every tool that times runs (race, noise, certify). A run that starts on an empty cache
folder compiles everything (cold); one that finds compiled graphs there reuses them (warm), and its
compile seconds, and often its first timed steps, are not the same measurement. #92 timed every leg
cold; #367 and #371 kept their caches warm. Mixing the two in one comparison is refused unless asked.

The state is measured, never assumed: the files and bytes under the folder before the run starts, and
the compile seconds the run logs (`warm-up: ... compiled in S s`, train/loop.py)."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from speedrun.errors import ConfigError

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # where inductor (and triton, below it) caches compiled code
COLD, WARM = "cold", "warm"
_COMPILED_IN = re.compile(r"^warm-up: .* compiled in ([0-9.]+) s\b")
_COMPILE_ON = re.compile(r"^batch: .*, compile (True|False),")


def cache_folder(environ: dict | None = None) -> Path:
    """The folder a run started with `environ` caches compiled code in: TORCHINDUCTOR_CACHE_DIR, else
    inductor's own default (`<tmp>/torchinductor_<user>`), asked of torch so the two never differ."""
    environ = os.environ if environ is None else environ
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV])
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir())


@dataclass
class CacheState:
    """What a run found in its cache folder when it started, and what it compiled."""

    folder: str
    files_before: int
    bytes_before: int
    state: str  # COLD (no file in the folder) | WARM
    compiled: bool | None = None  # the run's log says `compile True`; None: not known (yet)
    compile_s: float | None = None  # seconds its untimed compile warm-up took; None: none logged

    def as_dict(self) -> dict:
        return asdict(self)


def measure(folder: Path) -> CacheState:
    """The folder's state now: its files and their bytes (an absent folder is empty)."""
    files = size = 0
    for root, _dirs, names in os.walk(folder):
        for name in names:
            try:
                size += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue  # removed while we looked
            files += 1
    return CacheState(str(folder), files, size, WARM if files else COLD)


def after_run(state: CacheState, log_text: str) -> CacheState:
    """`state` with what the run's log.txt says it compiled and how long its compile warm-up took."""
    lines = log_text.splitlines()
    on = [m.group(1) == "True" for line in lines if (m := _COMPILE_ON.match(line))]
    took = [float(m.group(1)) for line in lines if (m := _COMPILED_IN.match(line))]
    state.compiled = on[0] if on else None
    state.compile_s = sum(took) if took else (0.0 if on and not on[0] else None)
    return state


def label(state: dict | None) -> str:
    """A recorded state as the reports say it: `cold`, `warm (1,234 files)`, or `unrecorded`."""
    if not state:
        return "unrecorded"
    if state["state"] == COLD:
        return COLD
    return f"{WARM} ({state['files_before']:,} files)"


def refuse_mixed(states: dict[str, dict | None], what: str, allow: bool) -> str:
    """The one cache state of the named runs (`cold` or `warm`), or a ConfigError in one line when they
    mix cold and warm (unless `allow`: then `mixed`). Unrecorded runs, and runs that compiled nothing (the
    cache cannot change their time), are not compared: `uncompiled` when no run compiled."""
    kinds: dict[str, str] = {}
    for name, state in states.items():
        if state and state.get("compiled") is not False:
            kinds.setdefault(state["state"], name)
    if len(kinds) <= 1:
        none = states and all(s and s.get("compiled") is False for s in states.values())
        return next(iter(kinds), "uncompiled" if none else "unrecorded")
    if allow:
        return "mixed"
    shown = "; ".join(f"{k} ({n})" for k, n in kinds.items())
    raise ConfigError(
        f"refused: {what} mixes cold and warm compile caches ({shown}); time them alike, or pass "
        "--allow-mixed-cache to compare them anyway"
    )


RECORD_FILE = "compile-cache.json"  # in each run folder of a race, ablation or noise study: its state


def record(folder: Path, state: CacheState) -> None:
    """Write the run in `folder`'s cache state (with what its log says it compiled) into the run folder,
    so the study's folder keeps holding run folders only (`compare OUT/*` reads them all)."""
    import json

    from speedrun.atomic import write_atomic

    try:
        log = (folder / "log.txt").read_text(encoding="utf-8", errors="replace")
    except OSError:
        log = ""
    text = json.dumps(after_run(state, log).as_dict(), indent=2, sort_keys=True) + "\n"
    write_atomic(folder / RECORD_FILE, text.encode())


def recorded(folders: list[Path]) -> dict[str, dict | None]:
    """Each run's recorded state (None: run before states were recorded, or reused from elsewhere)."""
    from speedrun.atomic import json_object

    states = {f.name: json_object(f / RECORD_FILE) for f in folders}
    return {name: state or None for name, state in states.items()}


def summary_line(states: dict[str, dict | None], kind: str) -> str:
    """The reports' line: the one state (or `mixed`) and the compile seconds of the runs that compiled."""
    took = [s["compile_s"] for s in states.values() if s and s.get("compile_s")]
    spent = f"; compile {min(took):.1f}-{max(took):.1f} s" if took else ""
    said = {
        "uncompiled": "no run compiled (a cache cannot change their times)",
        "unrecorded": "not recorded (runs from before it was)",
        "mixed": "cold and warm runs mixed (--allow-mixed-cache)",
    }
    return f"compile cache: {said.get(kind, f'{kind} in every compiled run')}{spent}"
