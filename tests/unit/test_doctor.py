"""`speedrun doctor`: each check on faked hosts (a healthy 8 x H100 node, then one thing wrong at a time),
the exit code (1 only on a fail), the recipe's memory against the GPU, and the real probes on this host."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path

import pytest

from speedrun.cli import main
from speedrun.tools import doctor
from speedrun.tools.doctor import Environment, Gpu, cmd_doctor, recipe_need, run_checks

H100 = Gpu("NVIDIA H100 80GB HBM3", 80 * doctor.GiB, (9, 0))
A100 = Gpu("NVIDIA A100-SXM4-80GB", 80 * doctor.GiB, (8, 0))
V100 = Gpu("Tesla V100-SXM2-32GB", 32 * doctor.GiB, (7, 0))


@dataclasses.dataclass
class FakeHost(Environment):
    """A host described by its answers: by default a healthy 8 x H100 node."""

    build: tuple[str, str | None] | str = ("2.10.0+cu128", "12.8")
    devices: tuple[Gpu, ...] = (H100,) * 8
    driver: str | None = "580.126.09"
    fa3_reason: str | None = None
    triton: str | None = "3.5.0"
    free: int = 200 * 10**9
    ram: tuple[int, int] | None = (1024 * doctor.GiB, 1000 * doctor.GiB)
    shm: int | None = 512 * doctor.GiB
    env: dict = dataclasses.field(default_factory=dict)
    libraries: tuple[str, ...] = (doctor.CUDART,)
    token_file: bool = False

    def gpus(self):
        return list(self.devices)

    def cache_dirs(self):
        return {"inductor": Path("/tmp/torchinductor_x"), "triton": Path("/home/x/.triton/cache")}

    def free_bytes(self, path):
        return self.free

    def has_library(self, soname):
        return soname in self.libraries


#: the Environment methods without arguments that answer a field of the fake as it is
for _method, _field in {
    "torch_build": "build", "hf_token_file": "token_file", "driver_version": "driver", "fa3": "fa3_reason",
    "triton_version": "triton", "host_memory": "ram", "shm_bytes": "shm", "environ": "env",
}.items():  # fmt: skip
    setattr(FakeHost, _method, lambda self, f=_field: getattr(self, f))


def statuses(host: Environment, need=None) -> dict[str, tuple[str, str]]:
    return {c.name: (c.status, c.detail) for c in run_checks(host, need)}


def run(host: Environment, recipe: str | None = None, nproc: int | None = None, overrides=()) -> int:
    return cmd_doctor(argparse.Namespace(recipe=recipe, nproc=nproc, overrides=list(overrides)), host)


def test_doctor_on_a_healthy_gpu_node_says_ok_to_everything(capsys):
    checks = statuses(FakeHost())
    assert checks.pop("memory") == ("skip", "no --recipe: no estimate to compare")
    assert {s for s, _ in checks.values()} == {"ok"}, checks
    assert "8 x NVIDIA H100 80GB HBM3, 80.0 GiB" in checks["gpu"][1]
    assert run(FakeHost()) == 0


@pytest.mark.parametrize(
    "change, name, status, words",
    [
        (dict(driver="575.57.08"), "driver", "warn", "575.57.08 < 580"),
        (dict(driver=None), "driver", "warn", "unknown"),
        (dict(build=("2.11.0.dev20260101+cu128", "12.8")), "torch", "warn", "nightly"),
        (dict(build=("2.10.0+git1234abc", "12.8")), "torch", "warn", "nightly"),
        (dict(build="ImportError: libtorch_cuda.so: cannot open"), "torch", "fail", "does not import"),
        (dict(libraries=()), doctor.CUDART, "fail", "missing"),
        (dict(fa3_reason="no cached build for this torch"), "fa3", "warn", "no cached build"),
        (dict(fa3_reason="not cached"), "fa3", "warn", "needs a Hugging Face token, without one: 401"),
        (
            dict(build=("2.11.0+cu130", "13.0"), driver="575.57.08"),
            "driver",
            "fail",
            "too old for torch's CUDA 13.0",
        ),
        (dict(build=("2.10.0+cu128", "12.8"), driver="550.54.15"), "driver", "warn", "550.54.15 < 580"),
        (dict(triton=None), "triton", "fail", "not importable"),
        (dict(free=5 * 10**9), "inductor cache", "warn", "5.0 GB free (< 10 GB)"),
        (dict(free=0), "triton cache", "fail", "0.0 GB free"),
        (dict(ram=(8 * doctor.GiB, 7 * doctor.GiB)), "host ram", "warn", "8.0 GiB"),
        (dict(shm=64 * 2**20), "/dev/shm", "warn", "0.06 GiB: NCCL"),
        (dict(env={"NCCL_P2P_DISABLE": "1"}), "nccl", "warn", "NCCL_P2P_DISABLE=1: GPU-to-GPU"),
        (dict(env={"NCCL_DEBUG": "INFO", "NCCL_P2P_DISABLE": "0"}), "nccl", "ok", "NCCL_DEBUG=INFO"),
        (dict(devices=(V100,)), "gpu", "warn", "no fast bf16"),
        (dict(devices=(A100,)), "gpu", "ok", "no FA3"),
    ],
)
def test_doctor_flags_each_trap_of_a_gpu_host(change, name, status, words, capsys):
    host = FakeHost(**change)
    checks = statuses(host)
    assert checks[name][0] == status and words in checks[name][1], checks[name]
    others = {
        s
        for n, (s, _) in checks.items()
        if n != name and not (name.endswith("cache") and n.endswith("cache"))
    }
    assert others <= {"ok", "skip"}, checks  # nothing else moved (both caches sit on the fake's one disk)
    assert run(host) == (1 if status == "fail" else 0)
    out = capsys.readouterr()
    assert f"{status:<4} {name}: " in out.out and ("0 failed" in out.err) == (status != "fail")


def test_doctor_says_nothing_of_a_token_when_one_is_there_to_fetch_fa3():
    for host in (
        FakeHost(fa3_reason="x", env={"HF_TOKEN": "hf_x"}),
        FakeHost(fa3_reason="x", token_file=True),
    ):
        status, text = statuses(host)["fa3"]
        assert status == "warn" and "401" not in text


def test_doctor_on_a_cpu_host_skips_the_gpu_checks_and_passes():
    checks = statuses(FakeHost(devices=(), build=("2.13.0+cpu", None), libraries=(), fa3_reason="x"))
    for name in ("driver", doctor.CUDART, "gpu", "fa3", "memory"):
        assert checks[name][0] == "skip", checks[name]
    assert checks["torch"] == ("ok", "2.13.0+cpu, CPU build (no CUDA runtime)")
    assert checks["triton"][0] == "ok"


@pytest.mark.parametrize("recipe, dtype", [("record-2026-07", "fp32"), ("demo", "bf16")])
def test_doctor_compares_the_recipes_estimate_with_the_gpu_the_guard_reads(recipe, dtype, monkeypatch):
    """The need is the memory guard's own number (train/plan/memory.guarded_bytes, compiled on CUDA with
    the family's margin, per process of 8, in the precision train/plan/precision.resolve picks on a GPU
    with fast bf16: the record pins fp32 autocast over bf16 weights, the demo's auto is bf16); a GPU one
    byte short of it fails, one that holds it passes."""
    import torch

    from speedrun.recipes import load_recipe
    from speedrun.train.plan import precision
    from speedrun.train.plan.memory import guarded_bytes

    need, how = recipe_need(recipe, [], cuda=True, world=8)
    monkeypatch.setattr(precision, "fast_bf16", lambda device_type: (True, "a GPU with bf16"))
    cfg = load_recipe(recipe)
    cfg = precision.effective_config(cfg, precision.resolve(cfg, torch.device("cuda")))
    assert need == guarded_bytes(cfg, 8, compiled=True)
    assert how == f"{recipe}, 8 processes, {dtype}, compiled"
    if recipe == "demo":
        return
    fits = FakeHost(devices=(Gpu("GPU", need, (9, 0)),) * 8)
    short = FakeHost(devices=(Gpu("GPU", need - 1, (9, 0)),) * 8)
    assert statuses(fits, (need, how))["memory"][0] == "ok"
    assert statuses(short, (need, how))["memory"][0] == "fail"
    assert run(short, recipe) == 1  # the command computes the same need (8 GPUs: 8 processes)
    one = recipe_need(recipe, [], cuda=True, world=1)[0]
    assert one > need  # one process holds all of the sharded optimizer state


def test_doctor_on_a_cpu_host_compares_the_estimate_with_available_ram():
    need, how = recipe_need("demo", ["train.compile=off"], cuda=False, world=1)
    assert how.endswith("eager")
    cpu = dict(devices=(), build=("2.13.0+cpu", None))
    assert statuses(FakeHost(**cpu, ram=(need * 2, need)), (need, how))["memory"][0] == "ok"
    assert statuses(FakeHost(**cpu, ram=(need * 2, need - 1)), (need, how))["memory"][0] == "fail"


def test_the_real_probes_parse_the_driver_file_and_find_libraries(tmp_path):
    env = Environment()
    env.driver_file = tmp_path / "version"
    env.driver_file.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  Sun Jul 27 2025\n"
        "GCC version:  gcc version 13.3.0\n"
    )
    assert env.driver_version() == "580.65.06"
    assert env.has_library("libc.so.6") and not env.has_library("libspeedrun-none.so.99")
    total, available = env.host_memory()
    assert total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") and 0 < available <= total
    assert env.free_bytes(tmp_path / "not" / "made") == env.free_bytes(tmp_path) > 0


def test_speedrun_doctor_on_this_host_prints_one_line_per_check(capsys):
    code = main(["doctor"])
    lines = capsys.readouterr().out.splitlines()
    names = [c.name for c in run_checks(Environment())]
    assert len(lines) == len(names) and all(re.match(r"(ok  |warn|fail|skip) \S", line) for line in lines)
    assert code == (1 if any(line.startswith("fail") for line in lines) else 0)
    if not __import__("torch").cuda.is_available():
        assert code == 0  # issue 44: on a CPU host doctor passes
