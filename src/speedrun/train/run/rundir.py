"""The run directory contract: config.json, metrics.jsonl, log.txt and summary.json, written by rank 0.
A new run goes into a new or empty folder; only `--resume` continues one that holds a run."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from speedrun.atomic import check_name_fits, json_object, open_regular, read_regular, write_atomic
from speedrun.config import Config
from speedrun.config.files import DECIDED, FIXED, RUN_ID
from speedrun.errors import ConfigError, DataError, SpeedrunError
from speedrun.printable import ESCAPE

CHECKPOINT_DIR = "checkpoints"  # checkpoints/step_NNNNNN/ inside a run (train/run/checkpoint.py writes them)
STEP_DIR = re.compile(r"step_(\d+)")
MANIFEST = "manifest.json"  # what every checkpoint folder holds
LOCK_FILE = ".speedrun.lock"  # flock()ed by the process training in the folder; harmless when left over
SUMMARY_FILE = "summary.json"
RUN_FILES = ("config.json", "metrics.jsonl", "log.txt", SUMMARY_FILE, LOCK_FILE, CHECKPOINT_DIR)
_LOG_START = b"code: speedrun "  # the first line of every log.txt (environment_report)
SUMMARY_KEYS = (
    "recipe",
    "steps",
    "final_val_loss",
    "final_val_bpb",
    "train_time_s",
    "wall_time_s",
    "tokens_per_s",
    "data_wait_s",
    "peak_memory_bytes",
    "precision",  # {"dtype": "bf16" | "fp32", "reason": why this device computes in it}
    "mfu_peak_flops",  # MFU's denominator: a GPU's datasheet dense bf16 peak, else a probed matmul peak
    "mfu_peak_source",
    "run_dir",
    "status",  # "finished" | "stopped" (a signal: a checkpoint was saved, --resume continues)
    "device_name",  # the hardware kind: GPU name ("NVIDIA H100 80GB HBM3") or "cpu (<model name>)"
    "world_size",  # processes that trained; with device_name what `verify` calls the hardware
    "data_source",  # the data folder's meta.json source (data.source is only a label beside data.dir)
    "flops_per_token",  # training FLOPs per token at the last step's windows (model/flops.py)
    "train_flops",  # Σ over steps of tokens × that step's count: compare/verify/ablate's FLOPs axis
    "timed_steps",  # steps inside the timed clock, over every start of the run
    "starts",  # each start (first, every --resume): {step, world_size, device_name, timing_warmup_steps,
    # precision: the dtype it computed in, the run's first choice kept (train/plan/precision.py)}
    "timed_through",  # the last step inside the clock (verify: extension steps are timed, #344)
    "extension_steps",  # the stages' extension (train.stages ext=N), the last steps of train.steps
    "eval_writes",  # validations that wrote a weight or gradient (verify: no backward at evaluation, #205)
    "sampled_candidates",  # #92: the candidate counts P the training loss used, ascending; [] = full softmax
    "val_classes",  # the classes validation's softmax ran over: the head's rows (verify: #92's full softmax)
)


def default_run_dir(recipe: str) -> Path:
    """`runs/<recipe>-<time>`, with a -2, -3, ... suffix when two runs start in the same second."""
    base = Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def enclosing_checkpoint(path: Path) -> Path | None:
    """The checkpoint folder `path` is or lies inside: a `step_N` folder in a `checkpoints` folder,
    or a folder holding a checkpoint manifest. None for any other path."""
    path = Path(os.path.abspath(path))
    for p in (path, *path.parents):
        if (p.parent.name == CHECKPOINT_DIR and STEP_DIR.fullmatch(p.name)) or (p / MANIFEST).is_file():
            return p
    return None


def refuse_checkpoint_folder(path: Path, resume: bool) -> None:
    """A run never lives in a checkpoint: `--resume CKPT` would write logs into it, and a new run
    made there would later be taken for a checkpoint of the run around it."""
    check_name_fits(path, "--resume" if resume else "--out")  # before any stat() inside it fails
    ckpt = enclosing_checkpoint(path)
    if ckpt is None:
        return
    run = ckpt.parent.parent
    if resume:
        raise ConfigError(
            f"--resume {path}: is a checkpoint of the run {run}, not a run; resume the run: "
            f"speedrun train --resume {run}"
        )
    raise ConfigError(f"--out {path}: is inside the checkpoint {ckpt}; choose a folder outside checkpoints")


def check_new(path: Path) -> None:
    """A new run goes only into a new or empty folder: never mix with (or overwrite) files not ours."""
    refuse_checkpoint_folder(path, resume=False)
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(f"--out {path} is a file, not a folder; choose a new folder")
    entries = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE)
    if not entries or _never_started(path, entries):
        return
    if (path / "config.json").is_file() and (path / "metrics.jsonl").exists():
        raise ConfigError(
            f"run directory {path} already holds a run; continue it with "
            f"`speedrun train --resume {path}` or choose another --out"
        )
    shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    raise ConfigError(f"--out {path} is not empty (holds {shown}); choose a new or empty folder")


def _never_started(path: Path, entries: list[str]) -> bool:
    """Whether `path` holds only what a run of ours leaves when it fails before step 0 (config.json, an
    empty metrics.jsonl, our log.txt, events): nothing to keep or resume there, so a new run may reuse it."""
    ours = {"config.json", "metrics.jsonl", "log.txt"}
    others = [e for e in entries if e not in ours and not e.startswith("events.out.tfevents.")]
    if not ours <= set(entries) or others:
        return False
    try:
        if (path / "metrics.jsonl").stat().st_size:
            return False
        with open(path / "log.txt", "rb") as f:
            return f.read(len(_LOG_START)) == _LOG_START
    except OSError:
        return False


def saved_run_id(path: Path) -> str | None:
    """The identity config.json of the run `path` records (None: a run from before run ids)."""
    value = json_object(Path(path) / "config.json").get(RUN_ID)
    return value if isinstance(value, str) and value else None


def saved_decisions(path: Path) -> dict[str, str] | None:
    """The hardware choices a run's first start recorded in its config.json (None: a run from before
    they were recorded, decided again); a value edited out of range is one ConfigError."""
    value = json_object(Path(path) / "config.json").get(DECIDED)
    if value is None:
        return None
    if not isinstance(value, dict) or any(
        value.get(k) not in ("bf16", "fp32") for k in ("dtype", "muon_ns_dtype")
    ):
        raise ConfigError(
            f'{path}/config.json: {DECIDED} must be {{"dtype": "bf16"|"fp32", "muon_ns_dtype": '
            f'"bf16"|"fp32"}} as the run wrote it, got {value!r} (edited?)'
        )
    return value


def _lock(path: Path) -> int:
    """Hold an exclusive flock on the run directory for as long as the returned fd stays open."""
    fd = open_regular(path / LOCK_FILE, os.O_RDWR | os.O_CREAT)  # a link here must not be truncated
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SpeedrunError(
            f"run directory {path} is in use by another speedrun process (pid {holder}); "
            "wait for it to finish or stop it first"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def read_records(path: Path) -> tuple[list[tuple[bytes, dict[str, Any]]], bytes | None]:
    """The (line, record) pairs of a metrics.jsonl and its torn last line (None if none); any other line
    that is not a record with a "step" is a DataError."""
    try:
        lines = read_regular(path).split(b"\n")
    except FileNotFoundError:
        return [], None
    except OSError as e:
        raise SpeedrunError(f"cannot read {path}: {e.strerror or e}") from None
    while lines and not lines[-1].strip():
        lines.pop()
    records, torn = [], None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with an integer step")
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if i == len(lines) - 1:
                torn = line
                break
            raise DataError(f"{path}: line {i + 1} is not a metrics record ({e}); fix or remove it") from None
        records.append((line, record))
    return records, torn


class RunDir:
    """Writes the run's files; on ranks other than 0 every method is a no-op. Rank 0 holds an exclusive
    lock on the folder until `close`; each line is one O_APPEND write, cut back off when it fails, so a
    full disk ends the run with one error line and never half a line."""

    def __init__(self, path: Path, enabled: bool = True, echo: bool = True, resume: bool = False):
        self.path = Path(path)
        self.resumed = resume
        self.enabled = enabled
        self.echo = echo
        self._lock_fd = self._log = self._metrics = None
        self._held: list[int] = []  # other locks the run holds until close (keep)
        self._broken = False  # after a failed write, logging stops so the first error is the one shown
        self.decided: dict[str, str] | None = None  # the first start's hardware choices (config.json)
        self.run_id = saved_run_id(self.path) if resume else uuid.uuid4().hex  # see config.RUN_ID
        if not enabled:
            return
        if resume:
            refuse_checkpoint_folder(self.path, resume=True)
        if resume and not (self.path / "config.json").exists():
            raise SpeedrunError(f"{path} is not a run directory (no config.json) and cannot be resumed")
        if not resume:
            check_new(self.path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock(self.path)
            if not resume:
                check_new(self.path)  # again under the lock: another process may have just started here
            self._log = self._open("log.txt")
            self._metrics = self._open("metrics.jsonl")
        except OSError as e:
            self.close()
            inside = e.filename and Path(e.filename) != Path(path)  # the lock or a log file: name it
            where = f"{path}/{Path(e.filename).name}" if inside else path
            raise SpeedrunError(f"cannot write run directory {where}: {e.strerror or e}") from None
        except BaseException:
            self.close()
            raise

    def _open(self, name: str) -> int:
        return open_regular(self.path / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def _append(self, fd: int, name: str, text: str) -> None:
        data = text.encode("utf-8", ESCAPE)  # a path's non-UTF-8 byte is logged as \xNN
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes written (disk full?)")
        except OSError as e:
            self._broken = True
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)  # no half line left behind
            raise SpeedrunError(f"cannot write {self.path / name}: {e.strerror or e}") from None

    def write_config(self, cfg: Config) -> None:
        if not self.enabled:
            return
        saved = {RUN_ID: self.run_id, **cfg.to_dict()} if self.run_id else cfg.to_dict()
        saved[FIXED] = sorted(cfg.fixed)
        if self.decided is not None:
            saved[DECIDED] = self.decided
        write_atomic(self.path / "config.json", (json.dumps(saved, indent=2) + "\n").encode())

    def truncate_metrics(self, step: int) -> None:
        """Drop records the resumed run writes again: after `step`, and validation at `step` (it runs after
        that step's checkpoint); a torn last line is dropped too, noted in log.txt."""
        if not self.enabled:
            return
        path = self.path / "metrics.jsonl"
        records, torn = read_records(path)
        # the loop writes step N's record before it saves checkpoint N: without it the file was
        # emptied, removed or replaced, and the resumed history would silently start mid-run
        if step > 0 and not any(r["step"] == step and "train_loss" in r for _, r in records):
            raise DataError(
                f"{path}: no record of step {step}, the step of the checkpoint (the file was removed, "
                "emptied or replaced?); restore it, or start a new run"
            )
        keep = [
            line + b"\n"
            for line, r in records
            if r["step"] < step or (r["step"] == step and "val_loss" not in r)
        ]
        os.close(self._metrics)
        self._metrics = None
        write_atomic(path, b"".join(keep))
        self._metrics = self._open("metrics.jsonl")
        if torn is not None:
            self.log(
                f"metrics.jsonl: dropped a torn last line ({len(torn)} bytes) left by an interrupted write"
            )

    def start_over(self, steps: int) -> None:
        """`--resume` of a run that stopped before its first checkpoint: start again at step 0 in its folder,
        dropping the attempt's metrics records (log.txt says so); a finished run stays."""
        if self.has_final_validation(steps):
            raise DataError(f"run in {self.path} already finished ({steps} of {steps} steps)")
        records, _torn = read_records(self.path / "metrics.jsonl")
        self.truncate_metrics(0)
        self.log(
            f"resume: no checkpoint in {self.path}, so the run starts again from step 0 (the "
            f"{len(records)} metrics record(s) of the attempt that stopped before its first checkpoint "
            "are dropped)"
        )

    def has_final_validation(self, steps: int) -> bool:
        """Whether metrics.jsonl holds the validation of step `steps` (a run killed during it has its last
        checkpoint but not this record); a torn last line does not count."""
        records, _torn = read_records(self.path / "metrics.jsonl")
        return any(r["step"] == steps and "val_loss" in r for _, r in records)

    def log(self, line: str = "", console: bool = True) -> None:
        if not self.enabled or self._broken:
            return
        if console and self.echo:
            print(line, flush=True)
        self._append(self._log, "log.txt", line + "\n")

    def metric(self, record: dict[str, Any]) -> None:
        if not self.enabled or self._broken:
            return
        self._append(self._metrics, "metrics.jsonl", json.dumps(record) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        """summary.json, atomically: SUMMARY_KEYS exactly; non-finite numbers become null (valid JSON)."""
        if not self.enabled:
            return
        write_summary(self.path, summary)

    def keep(self, fd: int | None) -> None:
        """Hold `fd` (a lock of the run, such as its data folder's: data/folder_lock.py) until `close`,
        on every rank."""
        if fd is not None:
            self._held.append(fd)

    def close(self) -> None:
        held, self._held = self._held, []
        for fd in (self._log, self._metrics, *held, self._lock_fd):  # the lock last: closing releases it
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._log = self._metrics = self._lock_fd = None


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write `run_dir/summary.json` atomically from a dict with exactly SUMMARY_KEYS."""
    if set(summary) != set(SUMMARY_KEYS):
        missing, extra = set(SUMMARY_KEYS) - set(summary), set(summary) - set(SUMMARY_KEYS)
        raise ValueError(f"summary keys differ: missing {sorted(missing)}, unexpected {sorted(extra)}")

    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    data = {k: clean(summary[k]) for k in SUMMARY_KEYS}
    path = Path(run_dir) / SUMMARY_FILE
    write_atomic(path, (json.dumps(data, indent=2, allow_nan=False) + "\n").encode())
    return path
