"""Numbers stored on one machine and compared on another (#35). fp32 sums in the order the kernels
choose, and the kernels depend on the CPU (AMD and Intel AVX-512 differ), torch, ATen's capability and
the oneDNN/MKL ISA environment: `speedrun.hardware.kernel_fingerprint`. Stored numbers record the
fingerprint they were made on; a test demands bit equality only on the same fingerprint, and elsewhere
agreement within the fp32 rounding it states. Numbers stored without a fingerprint never match one."""

from __future__ import annotations

from speedrun.hardware import kernel_fingerprint


def same_kernels(recorded: dict | None) -> bool:
    """Whether this host runs the kernels `recorded` (a stored kernel_fingerprint; None: not recorded)."""
    return recorded is not None and recorded == kernel_fingerprint()


def agree(ours: float, stored: float, rel: float, exact: bool) -> bool:
    """Equal when `exact` (the same kernels), else within `rel` of the stored value."""
    return ours == stored if exact else abs(ours - stored) <= rel * abs(stored)
