"""Hardware-aware precision, MFU that cannot pass 100 %, and runs that fit a time budget.

bf16 is ~100x slower than fp32 on a CPU without bf16 instructions (AVX2-only x86), ~4x faster on one
with AVX512-BF16 or AMX: `train.dtype=auto` must pick what this machine runs fast."""

import json
import math
import shutil
import time
from pathlib import Path

import pytest
import torch

from speedrun import hardware
from speedrun.recipes import load_recipe
from speedrun.train.plan import precision
from speedrun.train.plan.budget import PROBE_STEPS, plan_steps
from speedrun.train.run.checkpoint import list_checkpoints
from tests.conftest import TINY, read_metrics, run_speedrun


@pytest.fixture
def fresh_probe():
    hardware.fast_bf16.cache_clear()
    yield
    hardware.fast_bf16.cache_clear()


def _slow_cpu(
    monkeypatch, flags: set[str] | None, capability: str = "AVX2", speedup: float = 0.01, arch: str = "x86_64"
) -> None:
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hardware.torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(hardware.platform, "machine", lambda: arch)
    monkeypatch.setattr(hardware, "onednn_bf16", lambda: True)
    monkeypatch.setattr(hardware, "bf16_speedup_probe", lambda: (speedup, 1.0))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)


@pytest.mark.parametrize(
    ("flags", "capability", "speedup", "env"),
    [
        ({"avx2", "fma"}, "AVX2", 5.0, None),  # AVX2-only: no bf16 instructions, whatever a probe says
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX2", 5.0, None),  # ATEN_CPU_CAPABILITY=avx2 on a BF16 host
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX512", 0.02, "AVX2"),  # oneDNN limited: the probe says slow
        (None, "AVX512", 0.5, None),  # flags unreadable: the probe decides
        (None, "AVX512", 1.1, None),  # ... and bf16 needs a clear margin over parity
    ],
)
def test_a_cpu_without_fast_bf16_never_gets_bf16_autocast_under_auto(
    monkeypatch, fresh_probe, flags, capability, speedup, env
):
    _slow_cpu(monkeypatch, flags, capability, speedup)
    if env:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", env)
    chosen = precision.resolve(load_recipe("demo"), torch.device("cpu"))
    assert chosen.dtype == "fp32" and chosen.autocast is None and "auto" in chosen.reason


def test_bf16_instructions_and_torchs_own_check_decide_without_a_probe(monkeypatch, fresh_probe):
    """AVX512-BF16 or AMX, ATen's AVX512 kernels and oneDNN's bf16 support: bf16, whatever a busy
    host's probe would measure (the probe is not even run); oneDNN saying no: fp32."""
    _slow_cpu(monkeypatch, {"avx512f", "avx512_bf16", "amx_bf16"}, "AVX512", speedup=0.01)
    monkeypatch.setattr(hardware, "bf16_speedup_probe", lambda: pytest.fail("probed"))
    chosen = precision.resolve(load_recipe("demo"), torch.device("cpu"))
    assert chosen.dtype == "bf16" and chosen.autocast is torch.bfloat16 and "amx_bf16" in chosen.reason
    hardware.fast_bf16.cache_clear()
    monkeypatch.setattr(hardware, "onednn_bf16", lambda: False)
    assert precision.resolve(load_recipe("demo"), torch.device("cpu")).dtype == "fp32"


def test_where_the_flags_are_silent_a_clearly_faster_probe_gets_bf16(monkeypatch, fresh_probe):
    _slow_cpu(monkeypatch, {"asimd", "bf16"}, "DEFAULT", speedup=3.5, arch="aarch64")  # ARM FEAT_BF16
    chosen = precision.resolve(load_recipe("demo"), torch.device("cpu"))
    assert chosen.dtype == "bf16" and "3.50x fp32's rate" in chosen.reason


def test_a_pinned_bf16_recipe_falls_back_with_its_storage_on_a_slow_cpu(monkeypatch, fresh_probe):
    _slow_cpu(monkeypatch, {"avx2"})
    cfg = load_recipe("unet-2024-11")
    cfg.train.dtype = "bf16"  # as a recipe that pins it: bf16 autocast + bf16 parameters
    assert cfg.model.bf16_model and cfg.model.embed_dtype == "bf16"
    chosen = precision.resolve(cfg, torch.device("cpu"))
    assert chosen.dtype == "fp32" and "falls back" in chosen.reason
    run_cfg = precision.effective_config(cfg, chosen)
    assert (
        run_cfg.train.dtype == "fp32" and not run_cfg.model.bf16_model and run_cfg.model.embed_dtype == "fp32"
    )
    assert cfg.train.dtype == "bf16" and cfg.model.bf16_model  # what the recipe asked is kept for config.json
    given = load_recipe("unet-2024-11", ["train.dtype=bf16"])  # the user's own bf16: kept, slow or not
    assert precision.resolve(given, torch.device("cpu")).dtype == "bf16"
    # a storage dtype the user set is theirs: the fallback leaves it (the rest of the storage falls back)
    mine = load_recipe("unet-2024-11", ["model.embed_dtype=bf16"])
    mine.train.dtype = "bf16"
    kept = precision.effective_config(mine, precision.resolve(mine, torch.device("cpu"))).model
    assert kept.embed_dtype == "bf16" and not kept.bf16_model
    # train.dtype=fp32 asked explicitly means "no autocast" and keeps the recipe's bf16 storage
    fp32 = load_recipe("unet-2024-11", ["train.dtype=fp32"])
    assert precision.effective_config(fp32, precision.resolve(fp32, torch.device("cpu"))).model.bf16_model


def _best_s(dtype: torch.dtype, size: int = 256) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


def test_the_choice_on_this_machine_matches_a_measurement(fresh_probe):
    """Independent of the rule's inputs: whatever CPU runs the suite, auto picks bf16 only if a bf16
    matmul measures faster than fp32 here (hosts differ ~100x, so noise cannot flip the answer)."""
    chosen = precision.resolve(load_recipe("demo"), torch.device("cpu"))
    bf16_faster = _best_s(torch.bfloat16) < _best_s(torch.float32)
    assert (chosen.dtype == "bf16") == bf16_faster, chosen.reason


def test_printed_mfu_never_exceeds_100_percent(text_data, tmp_path, monkeypatch):
    """A probe that underestimates the peak (here a cached 1 FLOP/s) prints no MFU rather than one above
    100 %, and is not raised to the rate reached (which printed 100 % on every line, #34)."""
    from speedrun.train.run import tracking

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    key = tracking._machine_key(torch.device("cpu"), torch.float32)
    tracking._write_peak(key, 1.0)
    out = tmp_path / "run"
    proc = run_speedrun(
        "train", "--out", str(out), f"data.dir={text_data}", *TINY, "train.dtype=fp32", "train.steps=6",
        "train.warmdown_steps=2", "train.log_every=1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    mfus = [line.split("MFU ")[1].split(" ")[0] for line in proc.stdout.splitlines() if "| MFU" in line]
    assert mfus == ["-"] * 6
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mfu_peak_flops"] == 1.0 and "probed" in summary["mfu_peak_source"]
    assert summary["precision"] == {"dtype": "fp32", "reason": "train.dtype=fp32"}


def test_budget_steps_formula():
    # 3 untimed warm-up steps, 4 timed ones took 2 s, then as many 0.5 s steps as fit the other 8 s;
    # never below done + warm-down (the warm-down starts with the next step at the earliest), at most the cap
    plan = dict(timed_s=2.0, timed_steps=4, untimed=3, step_s=0.5, done=7, tail=lambda n: 4)
    assert plan_steps(10.0, **plan, cap=1000) == 3 + 4 + 16
    assert plan_steps(10.0, **plan, cap=15) == 15
    assert plan_steps(1.0, **plan, cap=1000) == 7 + 4  # the budget is spent: the warm-down still runs
    # train.warmdown_frac: the warm-down is a share of the plan, so the floor is the fewest N with
    # N - ceil(0.3 N) >= 7 (brute force), and a spent budget ends on that floor, not on 7 + a fixed tail
    share = dict(plan, tail=lambda n: math.ceil(0.3 * n))
    floor = min(n for n in range(1, 100) if n - math.ceil(0.3 * n) >= 7)
    assert plan_steps(1.0, **share, cap=1000) == floor == 10
    assert plan_steps(10.0, **share, cap=1000) == 3 + 4 + 16


# A budget far below one step: the count is fixed at the first log point with PROBE_STEPS timed steps
# (step WARM + PROBE_STEPS) to the fewest the schedule allows: that step plus the warm-down.
WARM, WARMDOWN = 2, 4
FIXED = WARM + PROBE_STEPS + WARMDOWN
BUDGETED = [
    *TINY, "train.dtype=fp32", "train.steps=40", f"train.warmdown_steps={WARMDOWN}",
    f"train.timing_warmup_steps={WARM}", "train.time_budget_s=0.001", "train.log_every=1",
    "train.val_every=5", "train.checkpoint_every=3", "train.checkpoint_keep=0",
]  # fmt: skip


@pytest.fixture(scope="module")
def budgeted_run(text_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("budget") / "run"
    proc = run_speedrun("train", "--out", str(out), f"data.dir={text_data}", *BUDGETED)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
def test_a_time_budget_fixes_the_step_count_once_and_saves_it(budgeted_run):
    saved = json.loads((budgeted_run / "config.json").read_text())["train"]
    assert saved["steps"] == FIXED and saved["time_budget_s"] == 0.0
    train = [r for r in read_metrics(budgeted_run) if "train_loss" in r]
    assert [r["step"] for r in train] == list(range(1, FIXED + 1))
    for r in train:  # the trapezoid of FIXED steps at every step, as if FIXED had been asked for
        s = r["step"] - 1
        assert r["lr"] == pytest.approx(min((FIXED - s) / WARMDOWN, 1.0))
    log = (budgeted_run / "log.txt").read_text().splitlines()
    plans = [line for line in log if line.startswith("time budget ")]  # not the code diff atop
    assert len(plans) == 1 and f": {FIXED} steps (was 40, the most)" in plans[0]
    assert f"time budget: {FIXED} steps are final (train.steps was 40; saved in config.json)" in log


@pytest.mark.slow
@pytest.mark.parametrize("at_step", [3, 9])  # a checkpoint before the fix (step 6) and one after
def test_a_budgeted_run_resumes_exactly(budgeted_run, tmp_path, at_step):
    resumed = tmp_path / "resumed"
    shutil.copytree(budgeted_run, resumed)
    for path in list_checkpoints(resumed):
        if int(path.name.split("_")[1]) > at_step:
            shutil.rmtree(path)
    proc = run_speedrun("train", "--resume", str(resumed))
    assert proc.returncode == 0, proc.stderr

    def values(run: Path) -> list:
        return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in read_metrics(run)]

    assert values(resumed) == values(budgeted_run)


def test_a_budget_with_a_schedule_that_depends_on_the_step_count_is_refused():
    from speedrun.errors import ConfigError

    for extra in ("train.schedule=cosine", "model.window=512 model.window_warmup=ceil"):
        with pytest.raises(ConfigError, match="time_budget_s"):
            load_recipe("demo", ["train.time_budget_s=60", *extra.split()])
    # a warm-down share is planned with the count (test_auto_choices), so it no longer is
    shared = load_recipe("demo", ["train.time_budget_s=60", "train.warmdown_frac=0.3"])
    assert shared.train.warmdown_frac == 0.3


def test_host_fit_shrinks_until_the_minimum_steps_fit_and_no_further():
    from speedrun.model.families import build_model
    from speedrun.train.flops import step_flops_at
    from speedrun.train.plan.host_fit import shrink, shrinks_needed

    def _flops_per_step(c):  # a host whose step time is proportional to the step's FLOPs
        with torch.device("meta"):
            return step_flops_at(build_model(c.model), c, 0) * c.train.global_batch_tokens

    cfg = load_recipe("demo")  # 150 s, at least 120 steps, 8192 tokens of 4 x 256
    run_cfg = precision.effective_config(cfg, precision.Precision("fp32", "test"))
    flops = _flops_per_step(run_cfg)
    for step_s in (0.5, 2.0, 5.0, 20.0):  # a fast host, then ever slower ones; time scales with FLOPs

        def measure(c, step_s=step_s):
            return step_s * _flops_per_step(c) / flops

        n, _, seconds = shrinks_needed(run_cfg, measure)
        sized, fewer = load_recipe("demo"), load_recipe("demo")
        for _ in range(n):
            assert shrink(sized) is not None
        for _ in range(n - 1):
            shrink(fewer)
        assert seconds == pytest.approx(measure(sized))
        assert 150 / seconds >= 120 or shrink(sized) is None  # fits, or nothing is left to shrink
        if n:  # and one shrink fewer would not have fit
            assert 150 / measure(fewer) < 120
    assert shrinks_needed(run_cfg, lambda c: 0.5 * _flops_per_step(c) / flops)[0] == 0  # 300 steps fit
    assert shrinks_needed(run_cfg, lambda c: 5.0 * _flops_per_step(c) / flops)[0] > 0
    # 100 of the 120 steps fit: a recipe keeps its size unless the host is really too slow (hysteresis)
    assert shrinks_needed(run_cfg, lambda c: 1.5 * _flops_per_step(c) / flops)[0] == 0


@pytest.mark.slow
def test_a_slow_host_trains_a_smaller_model_recorded_in_the_config(text_data, tmp_path):
    out = tmp_path / "run"
    tiny = [o for o in TINY if "batch_tokens" not in o]  # the demo's batch: TINY's would be the user's
    args = [*tiny, "train.steps=12", "train.warmdown_steps=4", "train.time_budget_s=1000"]
    proc = run_speedrun(
        "train", "--out", str(out), f"data.dir={text_data}", *args, "train.budget_min_steps=100000000"
    )  # no host trains 10^8 steps in 1,000 s: everything shrinks to the floor
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((out / "config.json").read_text())
    assert saved["train"]["global_batch_tokens"] == 8 * 64 and saved["model"]["n_embd"] == 64
    assert saved["train"]["budget_min_steps"] == 0  # spent: a resume keeps these sizes
    log = (out / "log.txt").read_text().splitlines()
    fit = next(line for line in log if line.startswith(("host fit: train.", "host fit: model.")))  # the plan
    # the batch halved several times (TINY's width is already the floor): named once, its final value
    assert fit.startswith("host fit: train.global_batch_tokens=512 ("), fit


def test_compile_is_chosen_only_where_it_measures_clearly_faster(monkeypatch):
    from speedrun.train.plan import host_fit

    cfg = load_recipe("demo", ["train.budget_min_steps=0"])  # compile=auto, no size fit
    for eager_s, compiled_s, expect in ((1.0, 0.5, 1), (1.0, 0.95, 0), (0.5, 1.0, 0)):

        def probe(c, d, with_compiled=False, e=eager_s, k=compiled_s):
            return e, k if with_compiled else float("inf")

        monkeypatch.setattr(host_fit, "probe_steps", probe)
        lines: list[str] = []
        assert host_fit.measure(cfg, torch.device("cpu"), lines.append) == (0, expect)
        name = "compiled" if expect else "eager"
        assert lines == [lines[0]] and lines[0].startswith(
            f"compile: {name} (measured {eager_s * 1000:.0f} ms"
        )


def test_muon_iterates_in_fp32_only_where_bf16_is_slow(monkeypatch):
    from speedrun.optim import build as optimizers

    cpu = torch.device("cpu")
    for fast, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(optimizers, "fast_bf16", lambda _type, fast=fast: (fast, "test"))
        assert optimizers.muon_ns_dtype("auto", cpu) == want
        assert optimizers.muon_ns_dtype("bf16", cpu) == torch.bfloat16  # asked: kept, fast or not
        assert optimizers.muon_ns_dtype("fp32", cpu) == torch.float32
        from speedrun.model.families import build_model

        cfg = load_recipe("demo", ["model.n_layer=1", "model.n_embd=64", "model.n_head=2"])
        assert optimizers.build_optimizer(build_model(cfg.model), cfg).parts["muon"].ns_dtype == want


def test_fp32_newton_schulz_is_the_record_polynomial_without_bf16_rounding():
    """The iterations X <- aX + (bA + cA^2)X, A = XX^T, on X/||X||_F, written here in fp64 from the
    record's formula: fp32 iterations match them to ~1e-5, bf16 ones only to bf16's ~1e-2."""
    from speedrun.optim.orthogonalize import NS_COEFFICIENTS, newton_schulz

    g = torch.randn(48, 96, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = g / g.norm()
    a, b, c = NS_COEFFICIENTS
    for _ in range(5):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    fp32 = newton_schulz(g.float(), dtype=torch.float32)
    assert fp32.dtype == torch.float32
    assert (fp32.double() - x).abs().max() < 1e-4
    assert (newton_schulz(g.float()).double() - x).abs().max() > 1e-3  # bf16 (the default) rounds
