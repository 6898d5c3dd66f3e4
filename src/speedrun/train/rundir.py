"""The run directory contract: config.json, metrics.jsonl and log.txt, written by rank 0 only."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import speedrun
from speedrun.atomic import write_atomic
from speedrun.config import Config
from speedrun.errors import SpeedrunError


def default_run_dir(recipe: str) -> Path:
    return Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"


class RunDir:
    """Writes the run's files. On ranks other than 0 every method is a no-op, so callers need no checks."""

    def __init__(self, path: Path, enabled: bool = True, echo: bool = True, resume: bool = False):
        self.path = path
        self.enabled = enabled
        self.echo = echo
        self._log = None
        self._metrics = None
        if not enabled:
            return
        if resume and not (path / "config.json").exists():
            raise SpeedrunError(f"{path} is not a run directory (no config.json) and cannot be resumed")
        if not resume and (path / "metrics.jsonl").exists():
            raise SpeedrunError(f"run directory {path} already holds a run; choose another --out")
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._log = open(path / "log.txt", "a", encoding="utf-8")
            self._metrics = open(path / "metrics.jsonl", "a", encoding="utf-8")
        except OSError as e:
            raise SpeedrunError(f"cannot write run directory {path}: {e.strerror}") from None

    def write_config(self, cfg: Config) -> None:
        if not self.enabled:
            return
        write_atomic(self.path / "config.json", (json.dumps(cfg.to_dict(), indent=2) + "\n").encode())

    def truncate_metrics(self, step: int) -> None:
        """Drop records the resumed run will write again: anything after `step`, and validation at `step`
        (validation of a step happens before that step's training, after its checkpoint)."""
        if not self.enabled:
            return
        self._metrics.close()
        path = self.path / "metrics.jsonl"
        keep = []
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record["step"] < step or (record["step"] == step and "val_loss" not in record):
                keep.append(line + "\n")
        write_atomic(path, "".join(keep).encode())
        self._metrics = open(path, "a", encoding="utf-8")

    def has_final_validation(self, steps: int) -> bool:
        """Whether metrics.jsonl holds the validation of step `steps` (a run killed during its final
        validation has its last checkpoint but not this record, and resume must still produce it)."""
        path = self.path / "metrics.jsonl"
        if not path.exists():
            return False
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step") == steps and "val_loss" in record:
                return True
        return False

    def log(self, line: str = "", console: bool = True) -> None:
        if not self.enabled:
            return
        if console and self.echo:
            print(line, flush=True)
        self._log.write(line + "\n")
        self._log.flush()

    def metric(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def close(self) -> None:
        for f in (self._log, self._metrics):
            if f is not None:
                f.close()


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.rstrip()


def code_version() -> str:
    """Git commit plus the uncommitted diff when running from a checkout, else the package version."""
    src = Path(speedrun.__file__).resolve().parent
    commit = _run(["git", "rev-parse", "HEAD"], cwd=src)
    if commit is None:
        return f"speedrun {speedrun.__version__} (installed package)"
    diff = _run(["git", "diff", "HEAD", "--", "."], cwd=src.parent.parent) or ""
    state = "clean" if not diff else "dirty"
    text = f"speedrun {speedrun.__version__} git {commit} ({state})"
    return text + ("\n--- uncommitted diff ---\n" + diff + "\n--- end of diff ---" if diff else "")


def cpu_description() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}"


def environment_report() -> str:
    """Everything needed to tell two runs' environments apart (goes to log.txt)."""
    lines = [
        f"code: {code_version()}",
        f"python: {sys.version.split()[0]}  torch: {torch.__version__}  cuda: {torch.version.cuda or 'none'}",
        f"platform: {platform.platform()}",
        f"cpu: {cpu_description()}",
        f"command: {' '.join(sys.argv)}",
    ]
    smi = _run(["nvidia-smi"])
    if smi:
        lines += ["nvidia-smi:", smi]
    return "\n".join(lines)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
