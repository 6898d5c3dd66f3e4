"""What this machine's hardware runs fast, measured or read once: CPU flags, whether bf16 is fast (flags
and torch's own checks, a robust probe only where they are silent), which kernels run (a fingerprint for
stored numbers), the reachable matmul peak. A base module (torch only), so the optimizer, the precision
choice and the run record all read one answer (docs/design.md principle 12)."""

from __future__ import annotations

import functools
import os
import platform
import statistics
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


def measured_matmul_peak(device: torch.device, size: int, dtype: torch.dtype) -> float:
    """FLOP/s of one square `size` matmul in `dtype` on `device`, after a few warm-up calls: one sample
    of the reachable peak MFU is measured against (train/run/tracking.py repeats it, takes the median)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    a @ b
    sync(device)
    return 2 * size**3 / (time.perf_counter() - start)


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags: torch's own CPU detection (cpuinfo, every OS) where this torch has it,
    else Linux /proc/cpuinfo (x86 `flags`, ARM `Features`); None where neither answers."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        found = {k for k, v in caps().items() if v is True}
        if found:
            return found
    flags = cpuinfo("flags", "Features")
    return set(flags.split()) if flags is not None else None


#: The environment variables that pick which CPU kernels oneDNN, MKL and ATen dispatch.
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
           "MKL_DEBUG_CPU_TYPE", "MKL_CBWR")  # fmt: skip


def kernel_fingerprint() -> dict[str, str]:
    """What decides which fp32 kernels run, so which order they sum in: CPU vendor and model, torch,
    ATen's capability and the ISA environment. Numbers stored on one fingerprint are equal bit for bit
    only on the same fingerprint; elsewhere they agree within fp32 rounding (AMD and Intel AVX-512
    kernels differ, #35)."""
    vendor = cpuinfo("vendor_id", "CPU implementer") or platform.processor() or "?"
    model = cpuinfo("model name", "Model", "Hardware") or getattr(torch.cpu, "get_capabilities", dict)().get(
        "cpu_name", "?"
    )
    env = " ".join(f"{k}={os.environ[k]}" for k in ISA_ENV if k in os.environ)
    return {
        "cpu": f"{vendor} {model} ({platform.machine()})",
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "isa_env": env,
    }


PROBE_SIZE = 256  # the probe's square matmul: big enough to use the kernels, small enough to repeat
PROBE_CHUNK_S = 0.01  # seconds of one timed chunk of calls (a slow arm: one call)
PROBE_ARM_S = 0.2  # seconds each arm runs in all, in at least PROBE_ROUNDS interleaved chunks
PROBE_ROUNDS = 20  # chunks per arm: a busy host leaves some of them unslowed
PROBE_SPREAD = 3.0  # an arm's median chunk this much slower than its fastest: a busy host, measure again
FAST = 1.25  # speedup from which bf16 is chosen: a margin over parity that the fastest chunks do not cross


def timed(a: torch.Tensor, calls: int) -> float:
    """Seconds of `calls` products `a @ a` (the probe's one timer, replaced by tests to simulate load)."""
    start = time.perf_counter()
    for _ in range(calls):
        a @ a
    return time.perf_counter() - start


def bf16_speedup_probe() -> tuple[float, float]:
    """bf16 over fp32 matmul rate on this CPU (> 1: bf16 is faster) and the worse arm's spread (median
    over fastest chunk). One thread (two threads on a busy 2-core host measure the scheduler); bf16 and
    fp32 chunks interleaved until each arm ran PROBE_ARM_S; each arm's fastest chunk per call, since load
    only ever adds time (a burst of load slows some chunks, never speeds one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        arms = [torch.randn(PROBE_SIZE, PROBE_SIZE, dtype=d) for d in (torch.bfloat16, torch.float32)]
        calls = [max(1, int(PROBE_CHUNK_S / max(timed(a, 1), 1e-6))) for a in arms]  # calibrated
        chunks: list[list[float]] = [[], []]
        while (
            len(chunks[0]) < PROBE_ROUNDS
            or min(sum(c) * n for c, n in zip(chunks, calls, strict=True)) < PROBE_ARM_S
        ):
            for a, n, seen in zip(arms, calls, chunks, strict=True):
                seen.append(max(timed(a, n), 1e-9) / n)
    finally:
        torch.set_num_threads(before)
    spread = max(statistics.median(c) / min(c) for c in chunks)
    return min(chunks[1]) / min(chunks[0]), spread


#: oneDNN ISA limits (ONEDNN_MAX_CPU_ISA) that still include native bf16 instructions.
BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10", "ALL", "DEFAULT")


def _library_says(flags: set[str] | None, capability: str) -> tuple[bool | None, str]:
    """The answer of the flags and torch's own checks (True/False), or None where they are silent (flags
    unreadable, ARM, oneDNN limited below bf16): then only a measurement can tell."""
    if flags is None:
        return None, "CPU flags unreadable"
    if not any(f in flags for f in BF16_FLAGS):
        return False, f"{platform.machine()} CPU without bf16 instructions (capability {capability})"
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"{platform.machine()} CPU with bf16 instructions"
    if not capability.startswith("AVX512"):
        return False, f"CPU capability {capability} (bf16 instructions unused)"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    if not isa.startswith(BF16_ISAS):
        return None, f"bf16 instructions, but ONEDNN_MAX_CPU_ISA={isa}"
    if not onednn_bf16():
        return False, "bf16 instructions, but torch's oneDNN reports no bf16 support"
    native = sorted(f for f in BF16_FLAGS if f in flags)
    return True, f"{', '.join(native)} instructions, oneDNN bf16 supported (capability {capability})"


def onednn_bf16() -> bool:
    """torch's own check that its oneDNN runs bf16 on this CPU (False where torch lacks the check)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check is not None and torch.backends.mkldnn.is_available() and check())


def bf16_is_probed(device_type: str) -> bool:
    """Whether `fast_bf16` measures (a CPU whose flags and torch's checks are silent): only then may two
    processes decide differently."""
    if device_type != "cpu":
        return False
    return _library_says(cpu_flags(), torch.backends.cpu.get_cpu_capability())[0] is None


@functools.cache
def fast_bf16(device_type: str) -> tuple[bool, str]:
    """Whether bf16 matmuls are fast on this device type ('cuda' or 'cpu'), and the evidence in words:
    the CPU flags and torch's own support check decide; a probe only where they are silent, and then
    bf16 only on a speedup of FAST or more (a probe spread by load measures again)."""
    if device_type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ok, "CUDA GPU" + ("" if ok else " without bf16 support")
    said, why = _library_says(cpu_flags(), torch.backends.cpu.get_cpu_capability())
    if said is not None:
        return said, why
    speedup, spread = bf16_speedup_probe()
    if spread > PROBE_SPREAD:  # a busy host: measured once more, the steadier of the two kept
        speedup, spread = min((speedup, spread), bf16_speedup_probe(), key=lambda r: r[1])
    numbers = f"bf16 matmul {speedup:.2f}x fp32's rate (fastest of >= {PROBE_ARM_S:g} s per arm, one thread, "
    numbers += f"interleaved; median/fastest {spread:.1f}x)"
    if speedup >= FAST:
        return True, f"{why}; {numbers} >= {FAST}"
    return False, f"{why}; {numbers} < {FAST}"
