"""What a run records about where it ran (log.txt's first lines, the peak memory): the code version
and uncommitted diff, the interpreter, torch, CPU and GPU, and the inductor settings that the record
rules restrict (`speedrun verify` reads them back)."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import speedrun

if TYPE_CHECKING:
    import torch


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.rstrip()


DIFF_START, DIFF_END = "--- uncommitted diff ---", "--- end of diff ---"  # around the diff in log.txt


def code_version() -> str:
    """Git commit plus the uncommitted diff when running from a checkout, else the package version."""
    src = Path(speedrun.__file__).resolve().parent
    commit = _run(["git", "rev-parse", "HEAD"], cwd=src)
    if commit is None:
        return f"speedrun {speedrun.__version__} (installed package)"
    diff = _run(["git", "diff", "HEAD", "--", "."], cwd=src.parent.parent) or ""
    state = "clean" if not diff else "dirty"
    text = f"speedrun {speedrun.__version__} git {commit} ({state})"
    return text + (f"\n{DIFF_START}\n{diff}\n{DIFF_END}" if diff else "")


def cpu_description() -> str:
    import torch  # here, not at the top: `speedrun compare` reads metrics with this module, torch-free

    from speedrun.hardware import cpuinfo

    model = cpuinfo("model name") or platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}"


#: Inductor reads its config from these variables; the rules allow only the default config (rule 3),
#: so the log records any that are set (`speedrun verify` reads the line).
INDUCTOR_ENV_PREFIX = "TORCHINDUCTOR_"


def inductor_environment() -> str:
    """`none`, or the TORCHINDUCTOR_* variables set for this process (the code itself never changes
    torch._inductor.config or passes a compile mode, so these are the only way off the defaults)."""
    found = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(INDUCTOR_ENV_PREFIX))
    return " ".join(found) or "none"


def environment_report() -> str:
    """Everything needed to tell two runs' environments apart (goes to log.txt)."""
    import torch

    lines = [
        f"code: {code_version()}",
        f"python: {sys.version.split()[0]}  torch: {torch.__version__}  cuda: {torch.version.cuda or 'none'}",
        f"platform: {platform.platform()}",
        f"cpu: {cpu_description()}",
        f"inductor env: {inductor_environment()}",
        f"command: {' '.join(sys.argv)}",
    ]
    smi = _run(["nvidia-smi"])
    if smi:
        lines += ["nvidia-smi:", smi]
    return "\n".join(lines)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory on CUDA; peak resident set size of the process on CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
