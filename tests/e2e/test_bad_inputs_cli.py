"""Bad inputs and faults of the command line: options and overrides in any order, arguments in other bytes,
the launch environment, signals, --seeds (docs/bad-inputs.md): each ends in one stderr line and exit 1 or
2, or works; nothing we do not own is lost, nothing is silently wrong."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from speedrun.train.run.checkpoint import list_checkpoints
from tests.bad_input_runs import FAST, LAUNCH_KEYS, XFF, _group_line, _main_on_a_terminal, one_line
from tests.conftest import run_speedrun, speedrun_command, wait_for_metrics


def test_sighup_stops_cleanly_like_sigterm(text_data, tmp_path):
    """A closed terminal or a dropped ssh sends SIGHUP: the run saves a checkpoint and says how to go on."""
    out = tmp_path / "run"
    overrides = [*FAST, "train.steps=400", "train.log_every=1", "train.dtype=fp32"]
    args = speedrun_command("train", "--out", str(out), f"data.dir={text_data}", *overrides)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_metrics(out, 2, timeout_s=900)  # a loaded machine can take minutes to reach step 1
    assert (out / "metrics.jsonl").read_text().count("\n") >= 2, "the run never reached its loop"
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGHUP, stderr
    assert "stopped by SIGHUP" in stderr and f"--resume {out}" in stderr and "Traceback" not in stderr
    assert list_checkpoints(out)  # the steps so far are saved


@pytest.mark.parametrize("out", [".", "/"])
def test_seeds_with_an_out_that_has_no_name(out):
    one_line(run_speedrun("train", "--seeds", "1,2", "--out", out, "--dry-run", *FAST), 2, "name a folder")


def test_overrides_may_follow_options(tmp_path):
    from speedrun.cli import _build_parser, parse

    def parsed(*argv: str):
        return parse(_build_parser(), list(argv))

    out = str(tmp_path / "x")
    before = parsed("train", "model.n_layer=2", "train.steps=3", "--out", out)
    after = parsed("train", "--out", out, "model.n_layer=2", "train.steps=3")
    between = parsed("train", "model.n_layer=2", "--out", out, "train.steps=3")
    assert after.overrides == before.overrides == between.overrides == ["model.n_layer=2", "train.steps=3"]
    assert after.out == before.out == between.out
    seeds = parsed("train", "--seeds", "1,2", "model.n_layer=2")
    assert seeds.seeds == "1,2" and seeds.overrides == ["model.n_layer=2"]
    runs = parsed("compare", "a", "--target", "3", "b")
    assert runs.runs == [Path("a"), Path("b")] and runs.target == 3


def test_a_dry_run_with_overrides_on_both_sides_of_an_option_is_the_same_run(tmp_path):
    out = str(tmp_path / "x")
    split = run_speedrun("train", "model.n_layer=3", "--out", out, "train.val_every=7", "--dry-run")
    together = run_speedrun("train", "model.n_layer=3", "train.val_every=7", "--out", out, "--dry-run")
    assert split.returncode == 0, split.stderr  # before: "unrecognized arguments: train.val_every=7"
    assert split.stdout == together.stdout and '"n_layer": 3' in split.stdout


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("args", [["recipes"], ["recipes", "demo"]])  # more than stdout's buffer, and less
def test_a_full_stdout_is_named_not_taken_for_a_full_disk(args):
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "speedrun", *args],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0] == "speedrun: error: cannot write standard output: No space left on device"


def test_arguments_in_other_bytes_and_an_ascii_terminal():
    code, out, err = _main_on_a_terminal("train", "--dry-run", f"train.wandb_project={XFF}")
    assert code == 0 and '"wandb_project": "\\xff"' in out, err
    code, out, err = _main_on_a_terminal("train", "--dry-run", f"model.n_layer={XFF}")
    assert code == 2 and len(err.splitlines()) == 1 and "model.n_layer: expected an integer" in err
    code, out, err = _main_on_a_terminal("recipes", encoding="ascii")  # descriptions hold '·', '…'
    assert code == 0 and "demo" in out, err


@pytest.mark.parametrize("argv", [["train", "--bogus"], ["sample", "run", "--bogus"], ["recipes", "a", "b"]])
def test_an_unrecognized_argument_names_the_command_whose_help_lists_the_options(argv):
    proc = run_speedrun(*argv)  # (before: `speedrun: unrecognized ...`, pointing at the top-level --help)
    line = f"speedrun: error: speedrun {argv[0]}: unrecognized arguments: {argv[-1]} (see --help)"
    assert proc.returncode == 2 and proc.stderr == line + "\n"


def test_seeds_repeat_the_steps_the_first_runs_time_budget_fixed(text_data, tmp_path, monkeypatch):
    """`--seeds` with a time budget: each run measured its own step time and fixed its own step count,
    so `compare` put the repeats in groups of one (no t-test). Later seeds now repeat the first run's
    resolved config. (Measured step times differ from run to run; here the budget rule says so.)"""
    import speedrun.train.plan.budget as budget

    counts = iter([6, 7, 8])
    monkeypatch.setattr(budget, "plan_steps", lambda *args: next(counts))
    budget = ["train.time_budget_s=60", "train.steps=20", "train.timing_warmup_steps=1", "train.log_every=1"]
    out = tmp_path / "rep"
    proc = run_speedrun("train", "--seeds", "1,2", "--out", str(out), f"data.dir={text_data}", *FAST, *budget)
    assert proc.returncode == 0, proc.stderr
    runs = [tmp_path / f"rep-seed{s}" for s in (1, 2)]
    assert [json.loads((r / "config.json").read_text())["train"]["steps"] for r in runs] == [6, 6]
    assert "n=2" in _group_line(run_speedrun("compare", *map(str, runs)).stdout)


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"WORLD_SIZE": "abc", "RANK": "0"}, "WORLD_SIZE='abc' must be an integer >= 1"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE='0' must be an integer >= 1"),
        ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),  # trained silently as a non-zero rank
        (
            {"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"},
            "RANK=3 must be below",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is not set but WORLD_SIZE=2"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' must be an integer >= 0"),
    ],
)
def test_a_broken_launch_environment_is_one_line(env, fragment, text_data, tmp_path, monkeypatch):
    for key in LAUNCH_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    one_line(
        run_speedrun("train", "--out", str(out), f"data.dir={text_data}", *FAST), 2, fragment, "torchrun"
    )
    assert not out.exists()  # refused before the run directory is made


def test_seeds_check_every_run_folder_before_the_first_run(text_data, tmp_path):
    (tmp_path / "run-seed2").mkdir()
    (tmp_path / "run-seed2" / "notes.txt").write_text("mine")
    proc = run_speedrun(
        "train", "--out", str(tmp_path / "run"), "--seeds", "1,2", f"data.dir={text_data}", *FAST
    )
    one_line(proc, 2, "run-seed2 is not empty")
    assert not (tmp_path / "run-seed1").exists()  # nothing trained before the refusal


def test_a_stray_rank_variable_does_not_silence_errors(monkeypatch, tmp_path):
    """Only rank 0 of a multi-process launch speaks; RANK=1 alone (a scheduler's variable) silenced
    every error of every command (exit 1 and nothing said)."""
    for key in LAUNCH_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    one_line(run_speedrun("compare", str(tmp_path)), 1, "not a run directory")


def test_a_stopped_train_seeds_goes_on_with_the_same_command(text_data, tmp_path, monkeypatch, capsys):
    """issue 46: the second seed stopped by SIGTERM; the same `train --seeds 1,2 --out` then refused
    (`run-seed1 already holds a run`) and the stop line named one run's `--resume`. Now the stop line names
    the same command, which reuses seed 1 and resumes seed 2 from its checkpoint."""
    import speedrun.train.loop as loop
    from speedrun.cli import main
    from speedrun.train.signals import StopSignals

    real_train, real_install = loop.train, StopSignals.install

    def stopped_at_once(self):  # the second seed's first log point finds a SIGTERM
        real_install(self)
        self.received = signal.SIGTERM
        return self

    def train(cfg, out, **kw):
        if cfg.train.seed == 2 and not kw.get("resume"):
            monkeypatch.setattr(StopSignals, "install", stopped_at_once)
        try:
            return real_train(cfg, out, **kw)
        finally:
            monkeypatch.setattr(StopSignals, "install", real_install)

    monkeypatch.setattr(loop, "train", train)
    out = tmp_path / "run"
    argv = ["train", "--seeds", "1,2", "--out", str(out), f"data.dir={text_data}", *FAST, "train.log_every=1"]
    assert main(argv) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "stopped by SIGTERM" in err and "run the same command again" in err and "--resume" not in err, err
    assert list_checkpoints(tmp_path / "run-seed2")
    assert main(argv) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "run-seed1: finished before, reused" in said
    for s in (1, 2):
        assert json.loads((tmp_path / f"run-seed{s}" / "summary.json").read_text())["status"] == "finished"
