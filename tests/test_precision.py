"""Hardware-aware precision, MFU that cannot pass 100 %, and runs that fit a time budget.

bf16 is ~100x slower than fp32 on a CPU without bf16 instructions (AVX2-only x86), ~4x faster on one
with AVX512-BF16 or AMX: `train.dtype=auto` must pick what this machine runs fast."""

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from speedrun.recipes import load_recipe
from speedrun.train import precision
from speedrun.train.budget import PROBE_STEPS, budget_steps
from speedrun.train.checkpoint import list_checkpoints
from tests.conftest import TINY, read_metrics, run_speedrun


@pytest.fixture
def fresh_probe():
    precision.fast_bf16.cache_clear()
    yield
    precision.fast_bf16.cache_clear()


def _slow_cpu(monkeypatch, flags: set[str], capability: str = "AVX2", speedup: float = 0.01) -> None:
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    monkeypatch.setattr(precision.torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(precision, "bf16_speedup_probe", lambda: speedup)


@pytest.mark.parametrize(
    ("flags", "capability", "speedup"),
    [
        ({"avx2", "fma"}, "AVX2", 5.0),  # AVX2-only: no bf16 instructions, whatever a probe says
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX2", 5.0),  # ATEN_CPU_CAPABILITY=avx2 on a BF16 host
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX512", 0.02),  # ONEDNN_MAX_CPU_ISA=AVX2: probe says slow
        (None, "AVX512", 0.5),  # flags unreadable: the probe decides
    ],
)
def test_a_cpu_without_fast_bf16_never_gets_bf16_autocast_under_auto(
    monkeypatch, fresh_probe, flags, capability, speedup
):
    _slow_cpu(monkeypatch, flags, capability, speedup)
    chosen = precision.resolve(load_recipe("demo"), torch.device("cpu"))
    assert chosen.dtype == "fp32" and chosen.autocast is None and "auto" in chosen.reason


def test_a_cpu_with_bf16_instructions_that_measures_fast_gets_bf16(monkeypatch, fresh_probe):
    _slow_cpu(monkeypatch, {"avx512f", "avx512_bf16", "amx_bf16"}, "AVX512", speedup=3.5)
    chosen = precision.resolve(load_recipe("demo"), torch.device("cpu"))
    assert chosen.dtype == "bf16" and chosen.autocast is torch.bfloat16 and "3.5x faster" in chosen.reason


def test_a_pinned_bf16_recipe_falls_back_with_its_storage_on_a_slow_cpu(monkeypatch, fresh_probe):
    _slow_cpu(monkeypatch, {"avx2"})
    cfg = load_recipe("unet-2024-11", ["train.dtype=bf16"])  # bf16 autocast + bf16 parameters
    assert cfg.model.bf16_model and cfg.model.embed_dtype == "bf16"
    chosen = precision.resolve(cfg, torch.device("cpu"))
    assert chosen.fell_back and chosen.dtype == "fp32" and "falls back" in chosen.reason
    run_cfg = precision.effective_config(cfg, chosen)
    assert (
        run_cfg.train.dtype == "fp32" and not run_cfg.model.bf16_model and run_cfg.model.embed_dtype == "fp32"
    )
    assert cfg.train.dtype == "bf16" and cfg.model.bf16_model  # what the user asked is kept for config.json
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
    """A probe that underestimates the peak (here a cached 1 FLOP/s) must not print MFU above 100 %."""
    from speedrun.train import tracking

    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    key = tracking._machine_key(torch.device("cpu"), torch.float32)
    (cache / "speedrun").mkdir(parents=True)
    (cache / "speedrun" / "matmul-peak.json").write_text(json.dumps({key: 1.0}))
    out = tmp_path / "run"
    proc = run_speedrun(
        "train", "--out", str(out), f"data.dir={text_data}", *TINY, "train.dtype=fp32", "train.steps=6",
        "train.warmdown_steps=2", "train.log_every=1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    mfus = [float(line.split("MFU ")[1].split("%")[0]) for line in proc.stdout.splitlines() if "MFU" in line]
    assert len(mfus) == 6 and max(mfus) <= 100.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mfu_peak_flops"] > 1.0  # raised to the rate reached
    assert summary["precision"] == {"dtype": "fp32", "reason": "train.dtype=fp32"}


def test_budget_steps_formula():
    # 3 untimed warm-up steps, then as many 0.5 s steps as fit 10 s; never below done + warm-down + 1
    assert budget_steps(10.0, 0.5, untimed=3, done=7, warmdown_steps=4, max_steps=1000) == 23
    assert budget_steps(10.0, 0.5, untimed=3, done=7, warmdown_steps=4, max_steps=15) == 15
    assert budget_steps(1.0, 0.5, untimed=3, done=7, warmdown_steps=4, max_steps=1000) == 12


# A budget far below one step: the count is fixed at the first log point with PROBE_STEPS timed steps
# (step WARM + PROBE_STEPS) to the fewest the schedule allows: that step plus the warm-down plus one.
WARM, WARMDOWN = 2, 4
FIXED = WARM + PROBE_STEPS + WARMDOWN + 1
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
    fixes = [line for line in log if line.startswith("time budget ")]  # not the code diff atop
    assert len(fixes) == 1 and f": {FIXED} steps" in fixes[0]


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

    for extra in ("train.schedule=cosine", "train.warmdown_frac=0.3"):
        with pytest.raises(ConfigError, match="time_budget_s"):
            load_recipe("demo", ["train.time_budget_s=60", extra])


def test_host_fit_shrinks_until_the_minimum_steps_fit_and_no_further():
    from speedrun.model.families import build_model
    from speedrun.train.host_fit import shrink, shrinks_needed

    def _flops_per_step(c):  # a host whose step time is proportional to the step's FLOPs
        with torch.device("meta"):
            return build_model(c.model).flops_per_token(c.train.seq_len) * c.train.global_batch_tokens

    cfg = load_recipe("demo")  # 150 s, at least 120 steps, 8192 tokens of 4 x 256
    run_cfg = precision.effective_config(cfg, precision.Precision("fp32", "test"))
    flops = _flops_per_step(run_cfg)
    for step_s in (0.5, 2.0, 5.0, 20.0):  # a fast host, then ever slower ones; time scales with FLOPs

        def measure(c, step_s=step_s):
            return step_s * _flops_per_step(c) / flops

        n, seconds = shrinks_needed(run_cfg, measure)
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


@pytest.mark.slow
def test_a_slow_host_trains_a_smaller_model_recorded_in_the_config(text_data, tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "train.steps=12", "train.warmdown_steps=4", "train.time_budget_s=1000"]
    proc = run_speedrun(
        "train", "--out", str(out), f"data.dir={text_data}", *args, "train.budget_min_steps=100000000"
    )  # no host trains 10^8 steps in 1,000 s: everything shrinks to the floor
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((out / "config.json").read_text())
    assert saved["train"]["global_batch_tokens"] == 8 * 64 and saved["model"]["n_embd"] == 64
    assert saved["train"]["budget_min_steps"] == 0  # spent: a resume keeps these sizes
    log = (out / "log.txt").read_text().splitlines()
    fit = next(line for line in log if line.startswith("host fit: "))
    # the batch halved several times (TINY's width is already the floor): named once, its final value
    assert fit.startswith("host fit: train.global_batch_tokens=512 ("), fit


def test_measured_compile_keeps_the_faster_module():
    from speedrun.train.host_fit import MeasuredCompile

    model, lines = torch.nn.Linear(2, 2), []
    for eager_s, compiled_s, expect in ((1.0, 0.5, "compiled"), (0.5, 1.0, "eager")):
        chooser = MeasuredCompile(model, lines.append)
        used = []
        for step in range(6):
            used.append(chooser.module(step))
            chooser.measured(step + 1, compiled_s if used[-1] is chooser.compiled else eager_s)
        assert used[:2] == [model, model] and used[2:4] == [chooser.compiled] * 2
        winner = chooser.compiled if expect == "compiled" else model
        assert used[4:] == [winner, winner] and lines[-1].startswith(f"compile: {expect} measured faster")


def test_muon_iterates_in_fp32_only_where_bf16_is_slow(monkeypatch):
    from speedrun.train import optimizers

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
