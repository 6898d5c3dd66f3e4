"""`speedrun doctor [--recipe R]`: a preflight of the host, one line per check (ok / warn / fail / skip)
and exit 1 when any check fails.

What it checks is what has cost runs before (issue 44, #92's README): the torch build (a nightly trains
with NaNs) and its CUDA runtime; the NVIDIA driver (too old for that runtime: no GPU at all; below 580
the whole step is ~35 % slower, silently);
the GPU and its memory against the recipe's estimate (train/plan/memory.py, as `train --dry-run`
and the memory guard use it); FlashAttention-3 from the local Hugging Face cache, offline, exactly
as a run loads it (when it does not, whether a token is there to fetch it: `get_kernel` without one
gets 401); triton; free disk for inductor's and triton's caches (>= 10 GB); host RAM;
/dev/shm; NCCL settings that slow or break a node; `libcudart.so.13`, which #92's kernels link.

Every probe of the host is one method of `Environment`, so the tests hand `run_checks` a fake host
(a driver of 575, a full disk, no FA3) and the checks themselves read nothing else."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

GiB = 2**30
MIN_DRIVER = 580  # #92's README: below it the step slows by ~35 % with no error
#: the oldest driver (major) each CUDA runtime major runs on at all (NVIDIA's minor-version compatibility)
DRIVER_FOR_CUDA = {13: 580, 12: 525, 11: 450}
CACHE_WARN_BYTES = 10 * 10**9  # #92's README: >= 10 GB free for the inductor and triton caches
CACHE_FAIL_BYTES = 1 * 10**9  # a compile of the record writes more than this
RAM_WARN_BYTES = 16 * GiB  # inductor's compile workers and the pinned loader
SHM_WARN_BYTES = 1 * GiB  # NCCL's intra-node transport lives in /dev/shm (a container's default is 64 MiB)
CUDART = "libcudart.so.13"
#: NCCL settings that make a node slow or fragile, with why (anything else NCCL_* is shown as set)
NCCL_TRAPS = {
    "NCCL_P2P_DISABLE": "GPU-to-GPU traffic goes through host memory",
    "NCCL_SHM_DISABLE": "intra-node traffic falls back to sockets",
    "NCCL_IB_DISABLE": "InfiniBand is off (matters across nodes)",
    "NCCL_BLOCKING_WAIT": "every collective blocks the host",
}


@dataclass(frozen=True)
class Check:
    status: str  # "ok" | "warn" | "fail" | "skip"
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.detail}"


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int
    capability: tuple[int, int]


class Environment:
    """The real host. Each method is one probe; a probe that cannot answer returns None."""

    driver_file = Path("/proc/driver/nvidia/version")
    meminfo_file = Path("/proc/meminfo")

    def torch_build(self) -> tuple[str, str | None] | str:
        """(torch version, CUDA runtime version or None), or the import error in words."""
        try:
            import torch
        except Exception as e:  # a broken install raises more than ImportError
            return f"{type(e).__name__}: {e}"
        return torch.__version__, torch.version.cuda

    def gpus(self) -> list[Gpu]:
        import torch

        if not torch.cuda.is_available():
            return []
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(Gpu(p.name, p.total_memory, (p.major, p.minor)))
        return out

    def driver_version(self) -> str | None:
        text = _read(self.driver_file)  # "NVRM version: NVIDIA UNIX ... Kernel Module ...  580.65.06  ..."
        found = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", text or "")
        if found:
            return found.group(1)
        if shutil.which("nvidia-smi") is None:
            return None
        try:
            proc = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        first = proc.stdout.strip().splitlines()
        return first[0].strip() if proc.returncode == 0 and first else None

    def fa3(self) -> str | None:
        """None when FA3 loads from the local cache, offline, as a run loads it; else why not."""
        from speedrun.model.gpt2026 import attention_tiers

        said: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
        attention_tiers.log.addHandler(handler)
        try:
            fn = attention_tiers.load_fa3()
        finally:
            attention_tiers.log.removeHandler(handler)
        return None if fn is not None else (said[-1] if said else "FA3 did not load")

    def triton_version(self) -> str | None:
        try:
            import triton
        except Exception:
            return None
        return triton.__version__

    def cache_dirs(self) -> dict[str, Path]:
        """Where inductor and triton write their compiled kernels on this host."""
        inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if not inductor:
            try:
                from torch._inductor.runtime.cache_dir_utils import cache_dir

                inductor = cache_dir()
            except Exception:
                inductor = str(Path(os.environ.get("TMPDIR", "/tmp")) / "torchinductor")
        triton = os.environ.get("TRITON_CACHE_DIR") or str(
            Path(os.environ.get("TRITON_HOME", Path.home())) / ".triton" / "cache"
        )
        return {"inductor": Path(inductor), "triton": Path(triton)}

    def free_bytes(self, path: Path) -> int | None:
        """Free bytes on the file system that holds `path` (or would: its nearest existing folder)."""
        for folder in (path, *path.parents):
            if folder.exists():
                try:
                    return shutil.disk_usage(folder).free
                except OSError:
                    return None
        return None

    def host_memory(self) -> tuple[int, int] | None:
        """(total, available) bytes of host RAM."""
        text = _read(self.meminfo_file)
        if text:
            fields = {
                line.split(":")[0]: int(line.split()[1]) * 1024
                for line in text.splitlines()
                if line.count(" ")
            }
            if "MemTotal" in fields:
                return fields["MemTotal"], fields.get("MemAvailable", fields["MemTotal"])
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
        return total, total

    def shm_bytes(self) -> int | None:
        try:
            return shutil.disk_usage("/dev/shm").total
        except OSError:
            return None

    def environ(self) -> Mapping[str, str]:
        return os.environ

    def hf_token_file(self) -> bool:
        """Whether a Hugging Face token file exists (`hf auth login` writes HF_HOME/token)."""
        home = self.environ().get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
        return (Path(home) / "token").is_file()

    def has_library(self, soname: str) -> bool:
        """Whether the dynamic loader finds `soname` (already loaded, on LD_LIBRARY_PATH, or in the
        nvidia-* wheels beside torch)."""
        try:
            ctypes.CDLL(soname)
            return True
        except OSError:
            pass
        import site

        roots = [Path(p) / "nvidia" for p in (*site.getsitepackages(), site.getusersitepackages())]
        return any(any(root.glob(f"*/lib/{soname}")) for root in roots if root.is_dir())


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


# ---- the checks: each reads only the environment (and the recipe's estimate)


def check_torch(env: Environment) -> Check:
    build = env.torch_build()
    if isinstance(build, str):
        return Check("fail", "torch", f"does not import ({build})")
    version, cuda = build
    runtime = f"CUDA runtime {cuda}" if cuda else "CPU build (no CUDA runtime)"
    if "dev" in version or "+git" in version:  # #92's README: a nightly loads and trains with NaNs
        return Check("warn", "torch", f"{version}, {runtime}: a nightly build (#92 trained NaNs on one)")
    return Check("ok", "torch", f"{version}, {runtime}")


def check_driver(env: Environment, gpus: list[Gpu]) -> Check:
    if not gpus:
        return Check("skip", "driver", "no CUDA device")
    version = env.driver_version()
    if version is None:
        return Check("warn", "driver", "version unknown (no /proc/driver/nvidia/version, no nvidia-smi)")
    try:
        major = int(version.split(".")[0])
    except ValueError:
        return Check("warn", "driver", f"version {version!r} unreadable")
    build = env.torch_build()
    runtime = build[1] if isinstance(build, tuple) else None
    need = DRIVER_FOR_CUDA.get(int(runtime.split(".")[0])) if runtime else None
    if need is not None and major < need:  # torch.cuda.is_available() says False, or the first kernel fails
        return Check(
            "fail", "driver", f"{version} is too old for torch's CUDA {runtime} runtime (needs >= {need})"
        )
    if major < MIN_DRIVER:
        return Check("warn", "driver", f"{version} < {MIN_DRIVER}: #92 measured a silent ~35 % slowdown")
    return Check("ok", "driver", version)


def check_gpus(gpus: list[Gpu]) -> Check:
    if not gpus:
        return Check("skip", "gpu", "no CUDA device (the CPU path runs)")
    kinds = sorted({g.name for g in gpus})
    text = f"{len(gpus)} x {', '.join(kinds)}, {min(g.total_bytes for g in gpus) / GiB:,.1f} GiB"
    low = min(g.capability for g in gpus)
    if low < (8, 0):
        return Check("warn", "gpu", f"{text}; compute capability {low[0]}.{low[1]} has no fast bf16")
    if low < (9, 0):
        return Check("ok", "gpu", f"{text}; sm{low[0]}{low[1]}: no FA3 or FP8 (Hopper's), next tiers run")
    return Check("ok", "gpu", text)


def check_memory(env: Environment, gpus: list[Gpu], need: tuple[int, str] | None) -> Check:
    """The recipe's estimated peak per process against the smallest GPU (or the host's free RAM)."""
    if need is None:
        return Check("skip", "memory", "no --recipe: no estimate to compare")
    needed, how = need
    if gpus:
        have, where = min(g.total_bytes for g in gpus), "the smallest GPU's total"
    else:
        ram = env.host_memory()
        if ram is None:
            return Check("warn", "memory", f"needs {needed / GiB:,.1f} GiB ({how}); host RAM unknown")
        have, where = ram[1], "available host RAM"
    text = f"needs {needed / GiB:,.1f} GiB per process ({how}); {where} {have / GiB:,.1f} GiB"
    return Check("ok" if needed <= have else "fail", "memory", text)


def check_fa3(env: Environment, gpus: list[Gpu]) -> Check:
    if not gpus:
        return Check("skip", "fa3", "no CUDA device")
    why = env.fa3()
    if why is not None:
        text = f"not loaded from the local cache ({why}); the next attention tier runs"
        environ = env.environ()
        if not (environ.get("HF_TOKEN") or environ.get("HUGGING_FACE_HUB_TOKEN") or env.hf_token_file()):
            # #92's README: kernels' get_kernel answered 401 on a host without a token
            text += "; fetching it (kernels' get_kernel, online) needs a Hugging Face token, without one: 401"
        return Check("warn", "fa3", text)
    return Check("ok", "fa3", "loads from the local Hugging Face cache, offline")


def check_triton(env: Environment, gpus: list[Gpu]) -> Check:
    version = env.triton_version()
    if version is None:  # inductor's GPU kernels are triton
        return Check("fail" if gpus else "warn", "triton", "not importable: compile on CUDA needs it")
    return Check("ok", "triton", version)


def check_caches(env: Environment) -> list[Check]:
    out = []
    for name, path in env.cache_dirs().items():
        free = env.free_bytes(path)
        if free is None:
            out.append(Check("warn", f"{name} cache", f"{path}: free space unknown"))
            continue
        text = f"{path}: {free / 1e9:,.1f} GB free"
        status = "fail" if free < CACHE_FAIL_BYTES else "warn" if free < CACHE_WARN_BYTES else "ok"
        out.append(Check(status, f"{name} cache", text + ("" if status == "ok" else " (< 10 GB)")))
    return out


def check_ram(env: Environment) -> Check:
    ram = env.host_memory()
    if ram is None:
        return Check("warn", "host ram", "unknown")
    total, available = ram
    text = f"{total / GiB:,.1f} GiB, {available / GiB:,.1f} GiB available"
    return Check("warn" if total < RAM_WARN_BYTES else "ok", "host ram", text)


def check_shm(env: Environment, gpus: list[Gpu]) -> Check:
    size = env.shm_bytes()
    if size is None:
        return Check("warn" if len(gpus) > 1 else "ok", "/dev/shm", "absent")
    text = f"{size / GiB:,.2f} GiB"
    if size < SHM_WARN_BYTES and len(gpus) > 1:
        return Check("warn", "/dev/shm", f"{text}: NCCL between GPUs needs more (docker --shm-size=16g)")
    return Check("ok", "/dev/shm", text)


def check_nccl(env: Environment) -> Check:
    environ = env.environ()
    setting = {k: v for k, v in environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))}
    traps = [
        f"{k}={setting[k]}: {why}" for k, why in NCCL_TRAPS.items() if setting.get(k, "0") not in ("", "0")
    ]
    if traps:
        return Check("warn", "nccl", "; ".join(traps))
    if not setting:
        return Check("ok", "nccl", "no NCCL_* settings (NCCL's defaults)")
    return Check("ok", "nccl", " ".join(f"{k}={v}" for k, v in sorted(setting.items())))


def check_cudart(env: Environment, gpus: list[Gpu]) -> Check:
    if not gpus:
        return Check("skip", CUDART, "no CUDA device")
    if env.has_library(CUDART):
        return Check("ok", CUDART, "found")
    return Check("fail", CUDART, "missing: #92's kernels link it (install cuda-cudart-13, LD_LIBRARY_PATH)")


def run_checks(env: Environment, need: tuple[int, str] | None = None) -> list[Check]:
    """Every check, in the order a reader fixes them; `need`: the recipe's (bytes, how) estimate."""
    torch_line = check_torch(env)
    gpus = env.gpus() if torch_line.status != "fail" else []
    return [
        torch_line,
        check_driver(env, gpus),
        check_cudart(env, gpus),
        check_gpus(gpus),
        check_memory(env, gpus, need),
        check_fa3(env, gpus),
        check_triton(env, gpus),
        *check_caches(env),
        check_ram(env),
        check_shm(env, gpus),
        check_nccl(env),
    ]


def recipe_need(recipe: str, overrides: list[str], cuda: bool, world: int) -> tuple[int, str]:
    """The recipe's estimated peak bytes per process as a run on this host would be guarded (CUDA: the
    compiled estimate with the family's measured margin; CPU: eager unless train.compile=on)."""
    import torch

    from speedrun.recipes import load_recipe
    from speedrun.train.loop import compiles
    from speedrun.train.plan.memory import guarded_bytes
    from speedrun.train.plan.precision import Precision, effective_config, resolve

    cfg = load_recipe(recipe, overrides)
    device = torch.device("cuda" if cuda else "cpu")
    # every GPU doctor passes (sm80+) runs bf16 fast: the CUDA answer of precision.resolve without a device
    gpu = Precision("fp32" if cfg.train.dtype == "fp32" else "bf16", "CUDA")
    precision = gpu if cuda else resolve(cfg, device)
    cfg = effective_config(cfg, precision)
    compiled = compiles(cfg, device)
    how = f"{cfg.recipe}, {world} process{'es' if world > 1 else ''}, {precision.dtype}, "
    how += "compiled" if compiled else "eager"
    return guarded_bytes(cfg, world, compiled), how


def cmd_doctor(args: argparse.Namespace, env: Environment | None = None) -> int:
    env = env or Environment()
    need = None
    if args.recipe is not None and not isinstance(env.torch_build(), str):  # else the torch line fails
        gpus = env.gpus()
        world = args.nproc or max(1, len(gpus))
        need = recipe_need(args.recipe, args.overrides, bool(gpus), world)
    checks = run_checks(env, need)
    for check in checks:
        print(check.line())
    failed = [c.name for c in checks if c.status == "fail"]
    warned = [c.name for c in checks if c.status == "warn"]
    verdict = f"doctor: {len(failed)} failed ({', '.join(failed) or 'none'}), {len(warned)} warnings"
    print(verdict, file=sys.stderr)
    return 1 if failed else 0
