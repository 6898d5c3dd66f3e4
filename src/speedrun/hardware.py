"""What this machine's hardware runs fast, measured or read once: CPU flags, a bf16 matmul probe, the
reachable matmul peak. A base module (torch only), so the optimizer, the precision choice and the run
record all read one answer (docs/design.md principle 12)."""

from __future__ import annotations

import functools
import platform
import time
from pathlib import Path

import torch

#: CPU flags (Linux /proc/cpuinfo) of instructions that run bf16 matmuls natively.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX512-BF16, x86 AMX, ARM FEAT_BF16


def cpuinfo(*keys: str) -> str | None:
    """The first /proc/cpuinfo value under one of `keys` (e.g. x86 `flags`, ARM `Features`, `model
    name`); None where the file or the key is missing (macOS, Windows, some containers)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value.strip()
    return None


def measured_matmul_peak(
    device: torch.device | str = "cpu", size: int = 4096, dtype: torch.dtype = torch.bfloat16, iters: int = 10
) -> float:
    """Best FLOP/s of a square `size` matmul in `dtype` on `device`: the reachable peak MFU is measured
    against (datasheet peaks are rarely reached). A few warm-up calls, then the fastest of `iters`."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    for _ in range(3):
        a @ b
    sync(device)
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (x86 `flags`, ARM `Features`); None where unreadable."""
    flags = cpuinfo("flags", "Features")
    return set(flags.split()) if flags is not None else None


def bf16_speedup_probe(size: int = 192) -> float:
    """bf16 over fp32 matmul rate of a small square matmul on this CPU (> 1: bf16 is faster). Bounded:
    about 0.3 s where bf16 is emulated, milliseconds where it is native."""
    rate = functools.partial(measured_matmul_peak, "cpu", size, iters=2)
    return rate(dtype=torch.bfloat16) / rate(dtype=torch.float32)


SLOW_WITH_FLAGS = 0.4  # bf16 over fp32 rate below which a CPU with bf16 flags is taken as emulating it


@functools.cache
def fast_bf16(device_type: str) -> tuple[bool, str]:
    """Whether bf16 matmuls are fast on this device type ('cuda' or 'cpu'), and the evidence in words."""
    if device_type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ok, "CUDA GPU" + ("" if ok else " without bf16 support")
    capability = torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags()
    arch = platform.machine()
    if flags is not None and not any(f in flags for f in BF16_FLAGS):
        return False, f"{arch} CPU without bf16 instructions (capability {capability})"
    if arch in ("x86_64", "AMD64") and not capability.startswith("AVX512"):
        return False, f"CPU capability {capability} (bf16 instructions unused)"
    speedup = bf16_speedup_probe()
    found = "bf16 instructions" if flags is not None else "flags unreadable"
    # Emulated bf16 (e.g. ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16) measures 10-100x slower than fp32;
    # native bf16 1.4-4x faster, but a busy core can halve one timing. With bf16 flags present only a
    # clear slowdown means emulation, so the same command never flips precision on a noisy probe.
    if speedup < (SLOW_WITH_FLAGS if flags is not None else 1.0):
        return False, f"{found}, but a bf16 matmul measured {1 / speedup:.1f}x slower than fp32"
    return True, f"{found}, bf16 matmul measured {speedup:.1f}x faster than fp32"
