"""Which plain ops this run replaces, decided once before the model is built (`train.perf`).

`off`: every op runs its plain body. `auto`: on CUDA with Triton importable, every kernel of
`speedrun.perf.kernels.REPLACES` is installed (a kernel stays in that table only while a GPU measurement
shows it at least as fast as its compiled twin: benchmarks/bench_kernels.py); on any other device the plain
bodies, so a CPU run is bit for bit the same under either setting.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

# the modules that declare the ops the kernels replace (importing them declares the names)
import speedrun.model.gpt2026.head  # noqa: F401
import speedrun.model.gpt2026.ngram  # noqa: F401
import speedrun.model.gpt2026.sampled  # noqa: F401
import speedrun.model.layers  # noqa: F401
import speedrun.optim.orthogonalize  # noqa: F401
import speedrun.optim.row_adam  # noqa: F401
from speedrun import ops


def on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def chosen(mode: str, device: torch.device) -> tuple[str, ...]:
    """The op names whose kernels this run uses: none with `off`, off CUDA or without Triton."""
    from speedrun.perf.kernels import REPLACES

    if mode == "off" or not on_cuda(device) or not has_triton():
        return ()
    return tuple(sorted(REPLACES))


def install(mode: str, device: torch.device) -> tuple[str, ...]:
    """Put every op back to its plain body, then install the chosen kernels; returns their op names."""
    from speedrun.perf.kernels import REPLACES

    ops.reset()
    names = chosen(mode, device)
    for name in names:
        module, attr = REPLACES[name].rsplit(".", 1)
        ops.install(name, getattr(importlib.import_module(module), attr))
    return names


def describe(mode: str) -> str:
    """The log line: which ops run kernels now."""
    names = sorted(ops.installed())
    if not names:
        return f"speed layer: plain ops (train.perf={mode})"
    return f"speed layer: kernels for {', '.join(names)} (train.perf={mode})"
