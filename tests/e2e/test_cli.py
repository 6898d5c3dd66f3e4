"""End to end through the console entry point: a tiny run writes the run directory; mistakes give one line."""

import json
import math
from pathlib import Path

import pytest

from speedrun.cli import main
from tests.conftest import TINY, run_speedrun
from tests.e2e import runner


@pytest.mark.slow
@runner.uses("tiny")
def test_tiny_run_writes_run_directory_and_learns(trained):
    # in a child process, as a user runs it: the one test of `python -m speedrun` end to end (runs.py `tiny`)
    proc = trained("tiny")
    out = proc.folder
    assert proc.code == 0, proc.stderr
    assert {"config.json", "metrics.jsonl", "log.txt"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["n_layer"] == 2 and config["train"]["steps"] == 30
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("step" in r for r in records)
    train_records = [r for r in records if "train_loss" in r]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train_records] == list(range(1, 31))
    assert [r["step"] for r in val] == [0, 10, 20, 30]
    assert val[0]["val_loss"] == pytest.approx(math.log(512), abs=0.05)  # zero-init head: uniform
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.8
    assert all(r["val_bpb"] > 0 for r in val)
    assert all(r["time_s"] >= 0 and r["tokens"] == r["step"] * 1024 for r in records)
    log = (out / "log.txt").read_text()
    for needle in ("code: speedrun", "python:", "torch:", "cpu:", "params:", "peak memory", "done: val loss"):
        assert needle in log
    assert "done: val loss" in proc.stdout


def test_dry_run_prints_param_count(capsys):
    assert main(["train", "--recipe", "gpt2-baseline", "--dry-run", "model.pad_vocab_to=1"]) == 0
    out = capsys.readouterr().out
    assert "params: 124439808" in out.splitlines()
    assert json.loads(out[: out.index("\nparams:")])["recipe"] == "gpt2-baseline"


def test_recipes_summary_wraps_the_description_to_the_terminal(capsys, monkeypatch):
    """(The index itself: tests/unit/test_recipe_index.py.)"""
    from speedrun.recipes import load_recipe

    monkeypatch.setenv("COLUMNS", "90")
    assert main(["recipes", "demo"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 90
    assert "ReLU²" in out and "\\u00b2" not in out  # Unicode, not JSON escapes
    assert " ".join(load_recipe("demo").description.split()) in " ".join(out.split())  # no word lost


def test_no_subcommand_prints_help_and_creates_nothing(tmp_path):
    proc = run_speedrun(cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "usage: speedrun" in proc.stdout and "train" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # no data/, no runs/


def test_version(capsys):
    import speedrun

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"speedrun {speedrun.__version__}"


@pytest.mark.parametrize("extra", [["--out", "elsewhere"], ["--recipe", "demo"]])
def test_resume_refuses_options_it_would_ignore(tmp_path, capsys, extra):
    assert main(["train", "--resume", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{extra[0]} cannot be used with --resume" in err[0]


def test_only_rank_zero_prints_user_errors(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--dry-run", "model.n_head=0"]) == 2
    assert capsys.readouterr().err == ""  # rank 0 says it once for everyone
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--dry-run", "model.n_head=0"]) == 2
    assert capsys.readouterr().err.startswith("speedrun: error: model.n_head must be >= 1")


def test_rank_specific_errors_are_printed_by_that_rank(capsys, monkeypatch):
    from speedrun.errors import ConfigError

    def no_gpu(*_a, **_k):
        error = ConfigError("local rank 3 has no GPU")
        error.rank_specific = True
        raise error

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr("speedrun.recipes.load_recipe", no_gpu)
    assert main(["train", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == "speedrun (rank 3): error: local rank 3 has no GPU"


def test_a_clean_stop_is_not_reported_as_an_error(capsys, monkeypatch):
    import signal

    from speedrun.train.signals import RunInterrupted

    def stopped(*_a, **_k):
        raise RunInterrupted.after(signal.SIGTERM, 5, Path("run/checkpoints/step_000005"), Path("run"))

    monkeypatch.setattr("speedrun.train.loop.train", stopped)
    assert main(["train", "train.steps=100"]) == 143
    err = capsys.readouterr().err.strip()
    assert err == (
        "speedrun: stopped by SIGTERM after step 5; saved checkpoint run/checkpoints/step_000005; "
        "resume with: speedrun train --resume run"
    )


def test_out_of_memory_and_os_errors_are_one_line(capsys, monkeypatch):
    import errno

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/x.bin")

    monkeypatch.setattr("speedrun.data.prepare.prepare", full)
    assert main(["prepare", "wiki-vital"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "speedrun: error: cannot write /data/x.bin: No space left on device"

    def oom(*_a, **_k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr("speedrun.train.loop.train", oom)
    assert main(["train", "train.steps=100"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("speedrun: error: out of memory")


@pytest.mark.parametrize(
    "args, code, fragment",
    [
        (["train", "--recipe", "nope", "--dry-run"], 2, "unknown recipe 'nope'"),
        (["train", "--dry-run", "model.n_layerz=3"], 2, "unknown config key 'model.n_layerz'"),
        (["train", "--dry-run", "train.steps=many"], 2, "train.steps: expected an integer"),
        (["train", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["train", "data.dir=/nonexistent/shards", "data.source=text:/x"], 1, "/nonexistent/shards"),
        (["prepare", "text:/nonexistent/file.txt"], 1, "/nonexistent/file.txt"),
        (["prepare", "nosuchsource"], 2, "nosuchsource"),
    ],
)
def test_user_mistakes_give_one_line_and_exit_code(args, code, fragment, tmp_path):
    proc = run_speedrun(*args, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speedrun: error:"), proc.stderr
    assert fragment in lines[0]
    assert "Traceback" not in proc.stderr


def test_vocab_mismatch_between_data_and_model_is_refused(text_data, tmp_path):
    proc = run_speedrun(
        "train", "--out", str(tmp_path / "r"), f"data.dir={text_data}", *TINY, "model.vocab_size=600"
    )
    assert proc.returncode == 1
    assert "vocab size 512 but model.vocab_size is 600" in proc.stderr
    proc = run_speedrun(
        "train", "--out", str(tmp_path / "r2"), f"data.dir={text_data}", *TINY, "data.tokenizer=gpt2"
    )
    assert proc.returncode == 1 and "tokenized with bpe:512" in proc.stderr


def test_corrupt_shard_is_refused(text_data, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(text_data, bad)
    shard = sorted(bad.glob("*_train_*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated body
    proc = run_speedrun("train", "--out", str(tmp_path / "r"), f"data.dir={bad}", *TINY)
    assert proc.returncode == 1 and shard.name in proc.stderr and "Traceback" not in proc.stderr


def test_first_signal_is_acknowledged_at_once(capfd):
    import os
    import signal
    import time

    from speedrun.train.signals import StopSignals

    signals = StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the Python-level handler runs between bytecodes
        assert signals.received == signal.SIGTERM
    finally:
        signals.restore()
    assert (
        "speedrun: SIGTERM received: stopping at the next log point and saving a checkpoint"
        in capfd.readouterr().err
    )


def test_a_closed_pipe_ends_quietly():
    """`speedrun recipes | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    import subprocess

    from tests.conftest import speedrun_command

    proc = subprocess.Popen(speedrun_command("recipes"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the CLI has written anything: every write hits a closed pipe
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and err == b"", err.decode()
