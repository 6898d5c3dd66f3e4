"""Automatic choices never override the user (docs/design.md 15; issue 27): the time budget, the host
fit, precision and compile touch only the keys the user left unset, the budget never exceeds
`train.steps` nor moves the schedule back, and the same command trains the same model on 1 and 2
processes."""

import json
import re
import types
from pathlib import Path

import pytest
import torch

from speedrun.cli import main
from speedrun.recipes import load_recipe
from tests import two_processes
from tests.conftest import read_metrics, run_speedrun

# the demo recipe (budget 150 s, host fit to 120 steps, compile and dtype auto) at a tiny size
SMALL = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.max_seq_len=64", "model.vocab_size=512",
    "data.tokenizer=bpe:512", "train.seq_len=64", "train.micro_batch_tokens=512",
    "train.global_batch_tokens=1024", "train.val_tokens=2048", "train.dtype=fp32",
]  # fmt: skip


def lrs(run: Path) -> list[float]:
    return [r["lr"] for r in read_metrics(run) if "train_loss" in r]


def test_a_step_count_below_the_budgets_plan_plus_warmdown_trains_exactly_those_steps(text_data, tmp_path):
    """The issue's command: the recipe's budget planned the count at step 8 as done + warm-down + 1 = 11
    after the warm-down had run (LR x0.5 at step 8, x1.0 at step 9), then crashed in the end summary
    (val_every=0: no val loss). The given train.steps wins: exactly 8 steps, the LR never rises."""
    out = tmp_path / "run"
    args = [f"data.dir={text_data}", *SMALL, "train.steps=8", "train.warmdown_steps=2", "train.val_every=0"]
    proc = run_speedrun("train", "--recipe", "demo", "--out", str(out), *args)
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in read_metrics(out) if "train_loss" in r] == list(range(1, 9))
    lr = lrs(out)
    assert all(b <= a for a, b in zip(lr, lr[1:], strict=False)), lr  # the schedule never jumps back
    assert json.loads((out / "summary.json").read_text())["steps"] == 8
    assert "time budget: skipped (train.steps=8 was given" in (out / "log.txt").read_text()
    # a budget the user gave that cannot act (planned at step 8, then 2 warm-down steps: 10 > 8): refused
    proc = run_speedrun(
        "train", "--recipe", "demo", "--out", str(tmp_path / "r2"), *args, "train.time_budget_s=60"
    )
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "train.time_budget_s=60 cannot act" in proc.stderr
    assert not (tmp_path / "r2").exists()


def test_explicit_batch_and_width_are_kept_under_a_slow_probe(text_data, tmp_path, monkeypatch):
    """A probe that finds the host far too slow shrinks what the recipe chose, never what was given."""
    from speedrun.train.plan import host_fit

    def probe(cfg, device, with_compiled=False):  # ~15 steps in 150 s, compiled or not
        return 10.0, 10.0 if with_compiled else float("inf")

    monkeypatch.setattr(host_fit, "probe_steps", probe)
    out = tmp_path / "run"
    given = [
        "train.global_batch_tokens=2048",
        "model.n_embd=128",
        "train.time_budget_s=2",
        "train.log_every=4",
    ]
    args = [f"data.dir={text_data}", *SMALL, *given]
    assert main(["train", "--recipe", "demo", "--out", str(out), *args]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["train"]["global_batch_tokens"] == 2048 and saved["model"]["n_embd"] == 128
    assert {"train.global_batch_tokens", "model.n_embd"} <= set(saved["fixed_by_user"])
    log = (out / "log.txt").read_text()
    assert "host fit: kept the size (model.n_embd, train.global_batch_tokens as given)" in log
    assert "compile: eager (measured 10000 ms eager, 10000 ms compiled" in log
    # the same probe does shrink the recipe's own batch and width (so the probe above could have)
    logged: list[str] = []
    shrunk = load_recipe("demo", ["train.dtype=fp32"])
    n, compiled = host_fit.measure(shrunk, torch.device("cpu"), logged.append)
    assert n > 0 and compiled == 0  # the recipe's own batch and width: halved
    assert any(line.startswith("host fit: train.global_batch_tokens=") for line in logged), logged


def _run_on_a_clock(text_data, out, monkeypatch, seconds, warmdown: int | str) -> tuple[dict, dict, list]:
    """The demo recipe under a 30 s budget on a simulated clock: step n (from 1) takes `seconds(n)`.
    Returns summary.json, config.json's train table and the LR at every step."""
    from speedrun.train import loop, timing

    now, steps = [0.0], [0]
    real_step = loop.train_step

    def step(*args, **kwargs):
        steps[0] += 1
        now[0] += seconds(steps[0])
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", step)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    budget = ["train.time_budget_s=30", "train.budget_min_steps=0", "train.compile=off"]
    assert main(["train", "--recipe", "demo", "--out", str(out), f"data.dir={text_data}", *SMALL, *budget,
                 warmdown if isinstance(warmdown, str) else f"train.warmdown_steps={warmdown}",
                 "train.val_every=0"]) == 0  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    saved = json.loads((out / "config.json").read_text())["train"]
    assert summary["status"] == "finished" and saved["steps"] == summary["steps"] == steps[0]
    assert saved["time_budget_s"] == 0
    return summary, saved, lrs(out)


def test_the_budget_is_used_when_the_host_speeds_up_after_the_probe(text_data, tmp_path, monkeypatch):
    """A simulated clock: 1 s a step for the first 8 steps (a busy machine), 0.4 s after. The count was
    fixed at step 8 from the first steps' mean (34 steps, 14 of the 30 s used); it is now planned again
    while the LR is constant, and the run ends cleanly without validations (val_every=0)."""
    summary, saved, lr = _run_on_a_clock(
        text_data, tmp_path / "run", monkeypatch, lambda n: 1.0 if n <= 8 else 0.4, warmdown=10
    )
    assert summary["final_val_loss"] is not None and summary["steps"] <= 300
    assert summary["train_time_s"] == pytest.approx(30.0, rel=0.1)
    assert all(b <= a for a, b in zip(lr, lr[1:], strict=False)) and lr[-1] < 1.0
    # the ETA never promised more than the budget, also before the first plan (train.steps is a cap)
    etas = re.findall(r"eta (\d+)m(\d+)s", (tmp_path / "run" / "log.txt").read_text())
    assert etas and max(int(m) * 60 + int(s) for m, s in etas) <= 30


def test_a_run_of_warm_up_steps_only_says_that_no_step_was_timed(text_data, tmp_path):
    out = tmp_path / "run"
    args = [f"data.dir={text_data}", *SMALL, "train.steps=2", "train.warmdown_steps=1"]  # warm-up: 4 steps
    assert main(["train", "--recipe", "demo", "--out", str(out), *args]) == 0
    done = next(line for line in (out / "log.txt").read_text().splitlines() if line.startswith("done: "))
    assert "no step timed" in done and "tok/s" not in done, done


def test_time_budget_zero_alone_turns_the_demos_budget_off():
    cfg = load_recipe("demo", ["train.time_budget_s=0"])  # was refused: budget_min_steps needs a budget
    assert cfg.train.time_budget_s == 0 and cfg.train.budget_min_steps == 0
    with pytest.raises(Exception, match="train.budget_min_steps=10 has no effect while train.time_budget_s"):
        load_recipe("demo", ["train.time_budget_s=0", "train.budget_min_steps=10"])  # both given: refused


def test_the_public_muon_iterates_in_the_dtype_the_device_runs_fast(monkeypatch):
    from speedrun import hardware
    from speedrun.optim import Muon

    p = torch.nn.Parameter(torch.randn(8, 8))
    for fast, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(hardware, "fast_bf16", lambda _type, fast=fast: (fast, "test"))
        assert Muon([p]).ns_dtype == want  # as train.dtype=auto
        assert Muon([p], ns_dtype=torch.bfloat16).ns_dtype == torch.bfloat16  # the caller's: kept


def test_a_given_bf16_is_kept_where_auto_would_fall_back(monkeypatch):
    from speedrun.train.plan import precision

    monkeypatch.setattr(precision, "fast_bf16", lambda _type: (False, "no bf16 here"))
    cpu = torch.device("cpu")
    assert load_recipe("muon-2024-10").train.dtype == "bf16"
    assert precision.resolve(load_recipe("muon-2024-10"), cpu).dtype == "fp32"  # the recipe's bf16 falls back
    kept = precision.resolve(load_recipe("muon-2024-10", ["train.dtype=bf16"]), cpu)
    assert kept.dtype == "bf16" and "as given" in kept.reason


def test_the_keys_the_user_fixed_are_known_and_saved(tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text('base = "demo"\n[model]\nn_layer = 3\n')
    cfg = load_recipe(str(mine), ["train.seed=5"])
    assert cfg.fixed == {"model.n_layer", "train.seed"}  # not the bundled demo's own keys
    assert load_recipe("demo").fixed == frozenset()


# ---- the same command on 1 and 2 processes: the same decisions, the same model ----
WORLDS = [
    *SMALL,
    "train.steps=16",
    "train.warmdown_steps=4",
    "train.time_budget_s=1000",
    "train.val_every=8",
]  # fmt: skip  (the budget's cap is reached: 16 steps; the host fit and compile are chosen by the probe)
two_processes.job("auto-choices", lambda data: ["--recipe", "demo", f"data.dir={data}", *WORLDS])


@pytest.mark.slow
@two_processes.SHARED
def test_one_and_two_processes_make_the_same_choices_and_train_alike(text_data, tmp_path_factory):
    """Both runs choose before step 1 from the same probe (rank 0, all cores, one process's work); the
    2-process run used to skip the compile choice and probe different work. Compiled or eager is the
    same computation (rounding: ~1e-5 here), and a probe this small can fall either way on a busy host,
    so the losses are compared to 1e-4 and the compile choice is only required to be made."""
    one = tmp_path_factory.mktemp("auto") / "w1"
    assert main(["train", "--recipe", "demo", "--out", str(one), f"data.dir={text_data}", *WORLDS]) == 0
    two = two_processes.run_dir("auto-choices", text_data, tmp_path_factory)
    a, b = (json.loads((r / "config.json").read_text()) for r in (one, two))
    assert a["train"]["compile"] in ("on", "off") and b["train"]["compile"] in ("on", "off")  # recorded
    for c in (a, b):
        del c["run_id"], c["train"]["compile"]
    assert a == b  # the same sizes, step count and settings
    for r in (one, two):
        lines = (r / "log.txt").read_text().splitlines()  # (not the code diff atop, which quotes them)
        first = next(i for i, line in enumerate(lines) if line.startswith("step     1/"))
        assert any(line.startswith("compile: ") for line in lines[:first]), r
        assert any(line.startswith("host fit: ") for line in lines[:first]), r
    la, lb = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in la] == [r["step"] for r in lb]
    for x, y in zip(la, lb, strict=True):
        for key in ("train_loss", "val_loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-4), (x, y)


@pytest.mark.slow  # end to end: an ablation of several runs
def test_ablate_trains_the_given_steps_and_arms_of_a_budget_train_the_baselines(text_data, tmp_path, capsys):
    """README: `ablate --recipe demo --set train.steps=60` trained 65 steps (the budget's plan); and each
    arm of a budgeted recipe planned its own count, so "vs baseline" mixed the switch with the steps."""
    small = [w for o in [*SMALL, f"data.dir={text_data}", "train.warmdown_steps=6"] for w in ("--set", o)]
    out = tmp_path / "given"
    argv = [
        "ablate",
        "--recipe",
        "demo",
        "--seeds",
        "1",
        "--out",
        str(out),
        *small,
        "--set",
        "train.steps=12",
    ]
    assert main([*argv, "model.qk_norm=false"]) == 0
    for run in out.iterdir():
        summary, last = json.loads((run / "summary.json").read_text()), read_metrics(run)[-1]
        assert summary["steps"] == 12 and summary["status"] == "finished", run
        assert summary["final_val_loss"] == last["val_loss"] and last["step"] == 12
    capsys.readouterr()
    out = tmp_path / "budget"
    budget = [
        "--set",
        "train.time_budget_s=2",
        "--set",
        "train.compile=off",
        "--set",
        "train.budget_min_steps=0",
    ]
    argv = ["ablate", "--recipe", "demo", "--seeds", "1", "--out", str(out), *small, *budget]
    assert main([*argv, "model.mlp_ratio=8"]) == 0
    printed = capsys.readouterr().out
    steps = {json.loads((run / "summary.json").read_text())["steps"] for run in out.iterdir()}
    assert len(steps) == 1 and f"every run takes the steps ({steps.pop()})" in printed


def test_a_host_that_slows_in_the_warm_down_ends_sooner_and_keeps_the_budget(
    text_data, tmp_path, monkeypatch
):
    """A simulated clock: 0.4 s a step until the planned warm-down begins, 1.2 s after (another job
    started). The plan is final by then; with the count kept, the 20 warm-down steps would take 24 s
    instead of 8 (over 50% past the 30 s budget). The warm-down ends sooner instead: the budget holds
    within 10%, the LR never rises, and config.json gives the count a resume trains."""
    from speedrun.train import loop

    slow_from: list[int] = []
    real_follow = loop.follow_budget

    def follow(budget, cfg, rcfg, done, *args, **kwargs):
        result = real_follow(budget, cfg, rcfg, done, *args, **kwargs)
        if not slow_from and budget.final(done):
            slow_from.append(done)
        return result

    monkeypatch.setattr(loop, "follow_budget", follow)
    summary, _, lr = _run_on_a_clock(
        text_data, tmp_path / "run", monkeypatch, lambda n: 0.4 if not slow_from else 1.2, warmdown=20
    )
    assert slow_from and summary["train_time_s"] == pytest.approx(30.0, rel=0.1)
    assert summary["steps"] < slow_from[0] + 20  # the warm-down was cut, not run in full
    assert all(b <= a for a, b in zip(lr, lr[1:], strict=False))


@pytest.mark.parametrize("step_s", [0.25, 2.0])
def test_a_warmdown_share_follows_the_plan_on_fast_and_slow_hosts(text_data, tmp_path, monkeypatch, step_s):
    """train.warmdown_frac under a budget: the warm-down is that share of the count the budget plans, so a
    fast host (~120 steps in 30 s) gets a long one and a slow host (~15) a short one, and neither overruns
    its budget; the LR is 1 until the warm-down, then falls linearly to the end (the record's formula with
    the final count N: min((N - s) / (0.3 N), 1)). A fixed warm-down of 30 steps would make the slow host
    run 8 + 30 steps, 2.5x its budget."""
    summary, saved, lr = _run_on_a_clock(
        text_data, tmp_path / "run", monkeypatch, lambda n: step_s, warmdown="train.warmdown_frac=0.3"
    )
    n = summary["steps"]
    assert saved["warmdown_frac"] == 0.3 and saved["warmdown_steps"] == 0
    assert summary["train_time_s"] == pytest.approx(30.0, rel=0.1)
    want = [min((n - s) / (0.3 * n), 1.0) for s in range(n)]
    assert lr == pytest.approx(want)
    assert (n > 100) if step_s < 1 else (n < 25)


def test_the_host_fit_probes_at_the_threads_the_run_trains_with(monkeypatch):
    """issue 46: the probe always took every core, while a single process the user started with
    OMP_NUM_THREADS=1 trains on one thread; it now probes as the run trains. Under torchrun (WORLD_SIZE > 1,
    each process one thread) it still takes every core, so the measure does not depend on the process
    count."""
    import os

    import torch

    from speedrun.train.plan.host_fit import all_cores

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for env, want in (
            ({"OMP_NUM_THREADS": "1"}, 1),
            ({}, cores),
            ({"OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}, cores),
        ):
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
            monkeypatch.delenv("WORLD_SIZE", raising=False)
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            with all_cores():
                assert torch.get_num_threads() == want, env
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
