"""Experiment tracking and utilisation: TensorBoard events in the run directory, optional Weights &
Biases (imported only when a project is named: the only network use here), MFU."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from speedrun.atomic import json_object
from speedrun.errors import ConfigError
from speedrun.hardware import cpuinfo, measured_matmul_peak
from speedrun.printable import printable

#: Datasheet dense bf16 tensor-core peaks (FLOP/s, no sparsity), by a substring of the device name.
DATASHEET_BF16_PEAK = {
    "H200": 989.4e12,
    "H100 NVL": 835.6e12,
    "H100 PCIe": 756.5e12,
    "H100": 989.4e12,  # SXM; the more specific names above are matched first
    "GH200": 989.4e12,
    "B200": 2.25e15,
    "A100": 312e12,
    "A10G": 70e12,
    "L40S": 362.05e12,
    "L4": 121e12,
    "RTX 4090": 165.2e12,
    "RTX 3090": 71e12,
}


def datasheet_peak(device_name: str) -> float | None:
    """Datasheet bf16 dense peak for a device name such as 'NVIDIA H100 80GB HBM3'; None when unknown."""
    for key, peak in DATASHEET_BF16_PEAK.items():  # insertion order: specific names before general ones
        if key in device_name:
            return peak
    return None


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def hardware_name(device: torch.device | str) -> str:
    """The device kind a run's time depends on: the GPU's name, or the CPU model for a CPU run
    (summary.json's `device_name`; `verify` refuses baselines timed on another kind)."""
    name = device_name(device)
    if name != "cpu":
        return name
    return f"cpu ({cpuinfo('model name', 'Model', 'Hardware') or platform.machine() or 'unknown'})"


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak (both per device); None without a
    peak to believe, or where the rate reached exceeds a probed peak (never printed above 100 %)."""
    if peak_flops is None:
        return None
    assert peak_flops > 0, peak_flops  # matmul_peak's answer (a datasheet value or a measured rate)
    ratio = flops_per_token * tokens_per_s / peak_flops
    return ratio if ratio <= 1.0 else None


def format_mfu(value: float | None) -> str:
    """`41.3%`, or `-` where `mfu` gave no number."""
    return "-" if value is None else f"{value:.1%}"


PROBE_S = 1.0  # at least this long of repeated one-thread matmuls: a shorter probe under-measured (#34)
PROBE_CALL_S = 0.05  # the size doubles until one call takes this long


def probe_matmul_peak(device: torch.device, dtype: torch.dtype, budget_s: float = PROBE_S) -> float:
    """A peak to believe, in `dtype`: one thread's matmul rate (the median of calls repeated for at least
    `budget_s`, at the first power-of-two size whose call takes PROBE_CALL_S) times the threads the run
    uses, on a CPU; the median call's rate on a GPU. One thread measures a core without the contention
    of several, so the product bounds what all of them can do."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        size = 128
        while size < 8192 and 2 * size**3 / measured_matmul_peak(device, size, dtype) < PROBE_CALL_S:
            size *= 2
        rates, start = [], time.perf_counter()
        while time.perf_counter() - start < budget_s or len(rates) < 5:
            rates.append(measured_matmul_peak(device, size, dtype))
    finally:
        torch.set_num_threads(threads)
    return statistics.median(rates) * (threads if device.type == "cpu" else 1)


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "speedrun" / "matmul-peak-v2.json"  # v1's short probes under-measured: not reused


def _machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """What the probe's answer depends on: the processor, torch, threads, dtype and ISA limits."""
    cpu = cpuinfo("model name") or platform.processor() or platform.machine()
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "") + "/" + torch.backends.cpu.get_cpu_capability()
    return f"{device_name(device)}|{cpu}|{isa}|torch {torch.__version__}|{torch.get_num_threads()}t|{dtype}"


def _read_peaks() -> dict[str, float]:
    known = json_object(_cache_file())
    return {k: float(v) for k, v in known.items() if isinstance(v, int | float) and v > 0}


def _write_peak(key: str, peak: float) -> None:
    cache = _cache_file()
    with contextlib.suppress(OSError):  # a read-only home only costs the next run its probe
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**_read_peaks(), key: peak}, indent=1))
        os.replace(tmp, cache)


def matmul_peak(device: torch.device, dtype: torch.dtype | None) -> tuple[float, str]:
    """MFU's denominator and its source: a known GPU's datasheet dense bf16 peak, else the probe (at least
    PROBE_S seconds) in the run's dtype, cached per machine in the user's cache folder."""
    dtype = dtype or torch.float32
    name = device_name(device)
    sheet = datasheet_peak(name) if device.type == "cuda" else None
    if sheet:
        return sheet, f"datasheet dense bf16 peak of {name}"
    key = _machine_key(device, dtype)
    cached = _read_peaks().get(key)
    if cached:
        return cached, "probed matmul peak (cached; one thread's median rate x threads)"
    peak = probe_matmul_peak(device, dtype)
    _write_peak(key, peak)
    return peak, "probed matmul peak (one thread's median rate x threads)"


class Tracker:
    """`log(step, scalars)` to TensorBoard (and W&B when asked); `close()` flushes. Rank 0 only: on other
    ranks construct it with `enabled=False` and every call is a no-op."""

    def __init__(
        self,
        run_dir: Path,
        wandb_project: str = "",
        config: Mapping[str, Any] | None = None,
        enabled: bool = True,
        run_name: str | None = None,
        log: Callable[[str], object] = print,
        purge_step: int | None = None,
    ):
        self.writer = self.wandb_run = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        if printable(name := str(run_dir)) == name:
            self.writer = SummaryWriter(log_dir=name, purge_step=purge_step)
        else:  # TensorBoard encodes paths as strict UTF-8: its first event would end in a traceback
            log(f"TensorBoard: no event files, as the run folder's name is not UTF-8 ({printable(name)})")
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ConfigError(
                    f"train.wandb_project={wandb_project} needs the wandb package (pip install wandb)"
                ) from None
            self.wandb_run = wandb.init(
                project=wandb_project, name=run_name or Path(run_dir).name, config=dict(config or {})
            )

    def log(self, step: int, scalars: Mapping[str, float | int | None]) -> None:
        """Record finite numbers under their names (e.g. 'train_loss', 'val_loss', 'lr', 'tokens_per_s')."""
        values = {k: float(v) for k, v in scalars.items() if isinstance(v, int | float) and v is not None}
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, global_step=step)
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
