"""Bad inputs and faults of run folders and checkpoints: what we write, what we refuse to write through,
damaged or unreadable checkpoints, failed starts (docs/bad-inputs.md): each ends in one stderr line and
exit 1 or 2, or works; nothing we do not own is lost, nothing is silently wrong."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from speedrun import atomic
from speedrun.errors import SpeedrunError
from speedrun.recipes import load_recipe
from tests.bad_input_runs import (
    FAST,
    SHORT,
    XFF,
    _main_on_a_terminal,
    _specials,
    _train,
    _untouched,
    copy_run,
    error_line,
    one_line,
)
from tests.conftest import TINY, run_speedrun


def test_files_we_write_never_follow_or_replace_links_pipes_or_devices(tmp_path):
    specials = _specials(tmp_path)
    for kind, path in specials.items():
        with pytest.raises(SpeedrunError, match=f"{path}: is a"):
            atomic.write_atomic(path, b"ours")
        with pytest.raises(SpeedrunError, match=f"{path}: is a"):
            os.close(atomic.open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT))
        assert kind in ("link", "fifo", "device")
    _untouched(tmp_path, specials)
    atomic.write_atomic(tmp_path / "plain.txt", b"ours")  # a regular file or a new name is written as before
    os.close(atomic.open_regular(tmp_path / "plain.txt", os.O_WRONLY | os.O_APPEND))
    assert (tmp_path / "plain.txt").read_bytes() == b"ours"
    folder = tmp_path / "big-disk"
    folder.mkdir()
    (tmp_path / "to-folder").symlink_to(folder)
    assert atomic.user_folder(tmp_path / "to-folder") == folder.resolve()  # followed: the user's chosen place
    with pytest.raises(SpeedrunError, match="not a folder"):
        atomic.user_folder(specials["link"])


def test_the_newest_checkpoint_is_chosen_by_step_number(finished, tmp_path):
    """Name sort put `step_6` after `step_000008` and `step_1000000` before `step_999999`; then
    checkpoint_keep deleted the newest."""
    from speedrun.train.run.checkpoint import list_checkpoints as listed

    root = tmp_path / "run" / "checkpoints"
    for name in ("step_999999", "step_6", "step_1000000", "step_000008"):
        (root / name).mkdir(parents=True)
    steps = [int(p.name.split("_")[1]) for p in listed(tmp_path / "run")]
    assert steps == sorted(steps) == [6, 8, 999999, 1000000]


@pytest.mark.parametrize("command", ["eval", "sample"])
def test_eval_and_sample_refuse_a_damaged_checkpoint(finished, tmp_path, command):
    run = copy_run(finished, tmp_path / "run")
    weights = run / "checkpoints" / "step_000003" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one changed byte in a weight: still loads, silently wrong
    weights.write_bytes(bytes(data))
    extra = ["--max-tokens", "2"] if command == "sample" else []
    one_line(run_speedrun(command, str(run), *extra), 1, "step_000003 is damaged", "sha256")


@pytest.mark.parametrize("where", ["checkpoints/step_000010", "checkpoints/step_000003/inner"])
def test_a_new_run_is_never_made_inside_a_checkpoint(finished, tmp_path, text_data, where):
    run = copy_run(finished, tmp_path / "run")
    out = run / where
    proc = run_speedrun("train", "--out", str(out), f"data.dir={text_data}", *FAST)
    one_line(proc, 2, "is inside the checkpoint")
    assert not out.exists()


def test_a_checkpoint_we_may_not_read_is_not_called_damaged(finished, monkeypatch):  # noqa: F811
    """(As root, chmod does not stop reads: the denial is injected where the files are read.)"""
    import pytest

    from speedrun.errors import SpeedrunError
    from speedrun.tools.runs import load_model
    from speedrun.train.run import checkpoint

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint, "_sha256", denied)
    with pytest.raises(SpeedrunError) as e:
        load_model(finished)
    assert str(e.value).startswith("permission denied: ") and "model.safetensors" in str(e.value)
    assert "damaged" not in str(e.value) and "mv " not in str(e.value)  # before: advised moving it away


def test_a_run_named_in_other_bytes_trains_resumes_evaluates_and_compares(text_data, tmp_path):
    data, run = Path(shutil.copytree(text_data, tmp_path / f"d{XFF}")), tmp_path / f"r{XFF}"
    args = ["--out", str(run), f"data.dir={data}", *FAST, "train.checkpoint_at_end=true"]
    code, out, err = _main_on_a_terminal("train", *args)
    assert code == 0, err
    for name in ("config.json", "summary.json", "checkpoints/step_000003/manifest.json"):
        json.loads((run / name).read_bytes())  # valid JSON (ASCII, with \udcff escapes) ...
    assert json.loads((run / "config.json").read_bytes())["data"]["dir"] == str(data)  # ... that reads back
    log = (run / "log.txt").read_bytes().decode("utf-8")  # valid UTF-8
    assert f"run dir {tmp_path}/r\\xff" in log and "TensorBoard: no event files" in log
    # the checkpoint is read (safetensors took only UTF-8 paths: it was called damaged)
    code, out, err = _main_on_a_terminal("train", "--resume", str(run))
    assert code == 1 and err.strip().endswith("already finished (3 of 3 steps)"), err
    assert _main_on_a_terminal("eval", str(run))[0] == 0
    assert _main_on_a_terminal("sample", str(run), "--max-tokens", "3", "--prompt", f"a{XFF}")[0] == 0
    other = shutil.copytree(run, tmp_path / f"r2{XFF}")
    code, out, err = _main_on_a_terminal(
        "compare", str(run), str(other), "--plot", str(tmp_path / f"p{XFF}.png")
    )
    assert code == 0, err
    assert "r\\xff " in out and (tmp_path / f"p{XFF}.png").stat().st_size > 0  # a legend matplotlib took


def test_read_weights_reads_what_safetensors_own_opener_reads(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from speedrun.train.run.checkpoint import read_weights

    tensors = {"w": torch.randn(3, 5), "b": torch.arange(4, dtype=torch.bfloat16)}
    save_file(tensors, tmp_path / "m.safetensors", metadata={"step": "12"})
    weights, metadata = read_weights(tmp_path / "m.safetensors")
    reference = load_file(tmp_path / "m.safetensors")
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        assert metadata == f.metadata()


def test_a_stopped_run_reports_the_steps_it_trained(text_data, tmp_path, monkeypatch):
    """Stopped by SIGTERM after 8 of 20 steps: summary.json (which compare, verify and ablate read) said
    20 steps (`train.steps`) and derived its tokens/s from the whole plan."""
    from speedrun.tools.results import load_run
    from speedrun.train import loop
    from speedrun.train.signals import RunInterrupted

    real, done = loop.train_step, []

    def step_then_stop(*args, **kwargs):
        loss = real(*args, **kwargs)
        done.append(1)
        if len(done) == 8:
            os.kill(os.getpid(), signal.SIGTERM)  # the run's handler asks for a stop at this step's end
        return loss

    monkeypatch.setattr(loop, "train_step", step_then_stop)
    overrides = [*TINY, f"data.dir={text_data}", "train.steps=20", "train.warmdown_steps=5"]
    cfg = load_recipe("demo", overrides)
    with pytest.raises(RunInterrupted):
        loop.train(cfg, tmp_path / "r")
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("stopped", 8)
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in metrics if "train_loss" in r) == 8
    assert load_run(tmp_path / "r").steps == 8


@pytest.mark.parametrize(
    ("argv", "flag", "code"),
    [
        (["train", "--out", "{long}", *TINY, *SHORT], "--out", 2),
        (["train", "--resume", "{long}"], "--resume", 2),
        (["prepare", "wiki-vital", "--tokenizer", "bpe:300", "--data-dir", "{long}"], "--data-dir", 2),
        (["verify", "{run}", "--json", "{long}"], "--json", 2),
        (["sample", "{long}"], "the name", 1),  # a path read, not made: the CLI's one OSError line
        (["eval", "{long}"], "the name", 1),
    ],
)
def test_an_over_long_name_is_named_not_a_file_inside_it(argv, flag, code, tmp_path):
    """An over-long `--out` reported `.../manifest.json: File name too long`: the first file looked for
    inside it. The name that is too long is named, with the file system's limit."""
    long = str(tmp_path / ("a" * 300))
    run = tmp_path / "run"
    run.mkdir()
    got = run_speedrun(*[a.format(long=long, run=run) for a in argv])
    err = error_line(got, code, flag, "is 300 bytes", "allows")
    assert "manifest.json" not in err and "config.json" not in err and "File name too long" not in err


@pytest.mark.parametrize("missing", ["model.safetensors", "config.json"])
def test_a_checkpoint_missing_a_file_is_called_damaged(checkpoint, missing):
    """`sample CKPT` of a checkpoint folder without its weights said `the run has no checkpoint; train
    with train.checkpoint_at_end=true`: the folder was taken for a run because it lacked the weights."""
    (checkpoint / missing).unlink()
    for command in ("sample", "eval"):
        got = run_speedrun(command, str(checkpoint))
        error_line(got, 1, f"checkpoint {checkpoint} is damaged (missing file {missing})")


def test_a_run_that_failed_before_step_0_can_be_started_again(text_data, tmp_path):
    out = tmp_path / "run"
    one_line(_train(tmp_path / "typo", out), 1, "data folder not found")
    assert (out / "config.json").is_file() and (out / "metrics.jsonl").read_bytes() == b""
    proc = _train(text_data, out)  # the same command with the folder fixed
    assert proc.returncode == 0, proc.stderr
    assert (out / "summary.json").is_file()


def test_a_folder_that_only_looks_like_a_failed_start_is_not_reused(text_data, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text("")
    (out / "log.txt").write_text("my notes\n")  # not our log
    one_line(_train(text_data, out), 2, "already holds a run")
    assert (out / "log.txt").read_text() == "my notes\n"


@pytest.mark.parametrize(
    "free, says", [(0, "no space left on device (0.0 MiB free"), (2**40, "enforce fail")]
)
def test_a_full_disk_under_torch_save_says_no_space(free, says, tmp_path, monkeypatch):
    """issue 46: torch.save on a full disk said `enforce fail at inline_container.cc`; with the disk full it
    now says "no space left on device" (and a disk with room keeps torch's own words). Nothing is left
    half-written."""
    import collections
    import shutil as sh

    import torch

    from speedrun.errors import SpeedrunError
    from speedrun.train.run import checkpoint as ckpt

    def full(*_a, **_k):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")

    monkeypatch.setattr(ckpt.torch, "save", full)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda _p: usage(2**41, 2**41 - free, free))
    with pytest.raises(SpeedrunError, match="cannot write checkpoint") as e:
        ckpt.save_checkpoint(tmp_path, 3, torch.nn.Linear(2, 2), {"step": 3}, {}, keep=1)
    assert says in str(e.value) and "\n" not in str(e.value), e.value
    assert not ckpt.list_checkpoints(tmp_path) and not list(tmp_path.rglob("*.tmp"))
