"""Which precision a run computes in, chosen from what the device runs fast, once, before step 0.

bf16 is the records' precision and a GPU's fast path, but a CPU without bf16 instructions (AVX2-only
x86 such as AMD Zen 1-3 or Intel client parts, or an ARM core without BF16) emulates it about 100x
slower than fp32. So `train.dtype="auto"` means bf16 autocast only where bf16 matmuls are fast, and a
recipe that pins `bf16` for fidelity keeps it on a GPU and on fast CPUs but falls back to fp32, with one
log line saying so, on a CPU where it would crawl (its bf16 parameter storage falls back with it); a
`train.dtype=bf16` the user gave (`cfg.fixed`) is kept, with a log line saying that it is slow here.

`fast_bf16(device)` decides from the CPU's flags and `torch.backends.cpu.get_cpu_capability()` (which
honours ATEN_CPU_CAPABILITY), confirmed by a sub-second matmul probe that also catches
ONEDNN_MAX_CPU_ISA limits and machines whose flags cannot be read. The answer is cached per process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from speedrun.config import Config
from speedrun.hardware import fast_bf16


@dataclass(frozen=True)
class Precision:
    """The resolved precision: autocast dtype (None = fp32, no autocast) and why, for the log and summary."""

    dtype: str  # "bf16" | "fp32"
    reason: str
    fell_back: bool = False  # a pinned bf16 recipe runs fp32 on this device

    @property
    def autocast(self) -> torch.dtype | None:
        return torch.bfloat16 if self.dtype == "bf16" else None

    def describe(self) -> str:
        return f"precision {self.dtype} ({self.reason})"


def resolve(cfg: Config, device: torch.device) -> Precision:
    """The precision `cfg` runs in on `device` (see the module doc)."""
    asked = cfg.train.dtype
    if asked == "fp32":
        return Precision("fp32", "train.dtype=fp32")
    fast, why = fast_bf16(device.type)
    if fast:
        return Precision("bf16", f"train.dtype={asked}: {why}")
    if asked == "auto":
        return Precision("fp32", f"train.dtype=auto: {why}")
    if "train.dtype" in cfg.fixed:  # the user asked for bf16: kept (principle 15), slow as it may be
        return Precision("bf16", f"train.dtype=bf16 as given, though slow here: {why}")
    return Precision("fp32", f"train.dtype=bf16 falls back to fp32: {why}", fell_back=True)


def effective_config(cfg: Config, precision: Precision) -> Config:
    """A copy of `cfg` with the dtype resolved, as the model, the step and validation use it. When a
    pinned bf16 recipe falls back, its bf16 parameter storage falls back too (it would also crawl)."""
    train = dataclasses.replace(cfg.train, dtype=precision.dtype)
    model = cfg.model
    if precision.dtype == "fp32" and cfg.train.dtype != "fp32":  # each family's bf16 storage fields
        fields = {f.name for f in dataclasses.fields(model)}
        storage = {"bf16_model": False, "embed_dtype": "fp32", "block_dtype": "fp32"}
        model = dataclasses.replace(model, **{k: v for k, v in storage.items() if k in fields})
    return dataclasses.replace(cfg, train=train, model=model)
