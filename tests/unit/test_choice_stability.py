"""Automatic choices from measurements you would believe (#35): the precision probe under bursts of load
decides as on a quiet host, the host fit never shrinks on a transient nor commits a shrink its step
misses, and a run's precision is decided once and kept by every --resume, recorded per start."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from speedrun import hardware
from speedrun.cli import main
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from speedrun.train.flops import step_flops_at
from speedrun.train.plan import host_fit
from speedrun.train.plan import precision as prec
from speedrun.train.run.checkpoint import list_checkpoints
from tests.conftest import TINY


@pytest.fixture
def fresh_probe():
    hardware.fast_bf16.cache_clear()
    yield
    hardware.fast_bf16.cache_clear()


@pytest.mark.parametrize("native", [True, False])
def test_a_probe_under_bursts_of_load_decides_as_on_a_quiet_host(monkeypatch, fresh_probe, native):
    """Flags unreadable, so the probe decides. bf16 runs 2x faster than fp32 (native) or 50x slower
    (emulated); each timed chunk waits 1x to 250x for other processes, as twelve calls at load ~5 did
    (0.25x to 2.87x from the old two-iteration probe). Twenty probes: one answer, on one thread."""
    cost = {torch.bfloat16: 0.5e-3 if native else 50e-3, torch.float32: 1e-3}
    rng, threads = random.Random(), set()

    def timed(a: torch.Tensor, calls: int) -> float:
        threads.add(torch.get_num_threads())
        return calls * cost[a.dtype] * rng.choice([1, 1, 3, 10, 250]) * rng.uniform(1.0, 1.1)

    monkeypatch.setattr(hardware, "timed", timed)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: None)
    decisions = set()
    for seed in range(20):
        rng.seed(seed)
        hardware.fast_bf16.cache_clear()
        decisions.add(hardware.fast_bf16("cpu")[0])
    assert decisions == {native} and threads == {1}


def _flops(cfg) -> float:
    with torch.device("meta"):
        return step_flops_at(build_model(cfg.model), cfg, 0) * cfg.train.global_batch_tokens


def _fit(monkeypatch, base_s: float, load: dict[int, float], busy: float) -> tuple[int, list[str]]:
    """host_fit.measure on the demo (150 s, >= 120 steps, eager) where a step takes `base_s` at the recipe's
    size and scales with its FLOPs, times the load at each probe call (`load[i]`, else `busy`)."""
    cfg = load_recipe("demo", ["train.dtype=fp32", "train.compile=off"])
    full, calls, lines = _flops(cfg), [0], []

    def probe(c, device, with_compiled=False):
        calls[0] += 1
        return base_s * _flops(c) / full * load.get(calls[0], busy), float("inf")

    monkeypatch.setattr(host_fit, "probe_steps", probe)
    n, compiled = host_fit.measure(cfg, torch.device("cpu"), lines.append)
    assert compiled == 0
    return n, lines


def test_host_fit_never_shrinks_on_a_transient(monkeypatch):
    """The first probe at the recipe's size caught a burst (10x); timed again, 300 steps fit: no shrink."""
    n, lines = _fit(monkeypatch, 0.5, {1: 10.0}, busy=1.0)
    assert n == 0, lines
    assert any("a transient, so nothing shrinks" in line for line in lines), lines


def test_host_fit_plans_again_when_the_shrunk_step_misses_its_prediction(monkeypatch):
    """A busy host (3x) went quiet while the first shrunk candidate was timed: one halving looked enough
    (1 s/step, 150 steps). Timed again before committing, the shrunk step takes 3 s: planned again from
    the busy times, three halvings (0.75 s/step) where one would leave ~50 steps of the 120."""
    n, lines = _fit(monkeypatch, 2.0, {2: 1.0}, busy=3.0)
    assert n == 3, lines
    assert any("the shrunk step measured 3000 ms, predicted 1000" in line for line in lines), lines
    fewer = load_recipe("demo", ["train.dtype=fp32", "train.compile=off"])
    for _ in range(2):
        host_fit.shrink(fewer)
    assert 150 / (2.0 * 3.0 * _flops(fewer) / _flops(load_recipe("demo"))) < 120  # and one fewer misses


def test_a_resume_keeps_the_precision_the_run_started_with(text_data, tmp_path, monkeypatch):
    """Started on a host without fast bf16 (auto: fp32), resumed on one with it: the run stays fp32
    (config.json's `decided` holds the choice, Muon's too), and each start records what it computed in."""
    auto = [o for o in TINY if o != "train.dtype=fp32"]
    args = [f"data.dir={text_data}", *auto, "train.steps=6", "train.warmdown_steps=2"]
    args += ["train.checkpoint_every=3", "train.checkpoint_keep=0", "train.val_every=3"]
    monkeypatch.setattr(prec, "fast_bf16", lambda _type: (False, "a host without fast bf16"))
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *args]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert (
        saved["decided"] == {"dtype": "fp32", "muon_ns_dtype": "fp32"} and saved["train"]["dtype"] == "auto"
    )
    for path in list_checkpoints(out)[1:]:  # as if stopped after step 3, then moved to a bf16 host
        shutil.rmtree(path)
    monkeypatch.setattr(prec, "fast_bf16", lambda _type: (True, "a host with fast bf16"))
    assert main(["train", "--resume", str(out)]) == 0
    starts = json.loads((out / "summary.json").read_text())["starts"]
    assert [(s["step"], s["precision"]) for s in starts] == [(0, "fp32"), (3, "fp32")]
    log = (out / "log.txt").read_text()
    assert "precision fp32 (train.dtype=auto: fp32 as the run started)" in log
    assert json.loads((out / "config.json").read_text())["decided"] == saved["decided"]


def test_stored_numbers_are_bit_for_bit_only_on_the_kernels_that_made_them(monkeypatch):
    """An AMD and an Intel AVX-512 host share the capability string but sum in other orders (#35: five
    failures on AMD); an ISA limit picks other kernels too. Each is another fingerprint."""
    from tests.stored import same_kernels

    def host(vendor: str, model: str) -> dict:
        info = {"vendor_id": vendor, "model name": model}
        monkeypatch.setattr(
            hardware, "cpuinfo", lambda *keys: next((info[k] for k in keys if k in info), None)
        )
        monkeypatch.setattr(hardware.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
        return hardware.kernel_fingerprint()

    for name in hardware.ISA_ENV:  # (the suite may itself run under an ISA limit)
        monkeypatch.delenv(name, raising=False)
    intel = host("GenuineIntel", "Intel(R) Xeon(R) Platinum 8488C")
    assert same_kernels(intel) and not same_kernels(None)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not same_kernels(intel)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    amd = host("AuthenticAMD", "AMD EPYC 9R14 96-Core Processor")
    assert amd["capability"] == intel["capability"] and not same_kernels(intel) and same_kernels(amd)
