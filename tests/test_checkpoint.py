"""Checkpoints, exact resume, signals and interrupted writes."""

import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from speedrun.errors import SpeedrunError
from speedrun.model.gpt import GPT
from speedrun.recipes import load_recipe
from speedrun.train import checkpoint as ckpt
from tests.conftest import TINY, read_metrics, run_speedrun, speedrun_command, wait_for_metrics

# fp32 on CPU: a resumed run must reproduce the uninterrupted one bit for bit.
RESUMABLE = [
    *TINY,
    "train.dtype=fp32",
    "train.steps=12",
    "train.warmdown_steps=4",
    "train.val_every=4",
    "train.checkpoint_every=3",
    "train.checkpoint_keep=0",
    "train.checkpoint_at_end=true",
]


def losses(records: list[dict]) -> list[tuple]:
    """What must be identical across a resume: (step, kind, value); times legitimately differ."""
    return [
        (r["step"], "val" if "val_loss" in r else "train", r.get("val_loss", r.get("train_loss")))
        for r in records
    ]


def rewind(run_dir: Path, copy: Path, step: int) -> None:
    """A copy of a finished run as it was when it had just written checkpoint `step`."""
    shutil.copytree(run_dir, copy)
    for path in ckpt.list_checkpoints(copy):
        if int(path.name.split("_")[1]) > step:
            shutil.rmtree(path)


@pytest.fixture(scope="module")
def straight_run(text_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "run"
    proc = run_speedrun("train", "--out", str(out), f"data.dir={text_data}", *RESUMABLE)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
@pytest.mark.parametrize("at_step", [3, 6])
def test_resume_reproduces_the_uninterrupted_run_exactly(straight_run, tmp_path, at_step):
    resumed = tmp_path / "resumed"
    rewind(straight_run, resumed, at_step)
    proc = run_speedrun(
        "train", "--resume", str(resumed), "train.log_every=2"
    )  # a harmless change is allowed ...
    assert proc.returncode == 0, proc.stderr
    assert "resume: train.log_every changed from 1 to 2" in proc.stdout  # ... and reported
    after = read_metrics(resumed)
    straight = read_metrics(straight_run)
    assert set(losses(after)) <= set(losses(straight))  # every value logged after the resume is identical
    assert [r for r in losses(after) if r[1] == "val"] == [r for r in losses(straight) if r[1] == "val"]
    # every record up to the checkpoint is kept once; after it, the resumed run logs every 2nd step
    assert [r for r in losses(after) if r[0] <= at_step] == [r for r in losses(straight) if r[0] <= at_step]
    assert losses(after)[-1] == losses(straight)[-1]  # the final validation
    assert f"resumed from checkpoint at step {at_step}" in (resumed / "log.txt").read_text()


@pytest.mark.slow
def test_sigterm_saves_and_resume_finishes_like_the_uninterrupted_run(straight_run, text_data, tmp_path):
    out = tmp_path / "run"
    args = speedrun_command(
        "train", "--out", str(out), f"data.dir={text_data}", *RESUMABLE, "train.checkpoint_every=0"
    )
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_metrics(out, 4)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert f"resume with: speedrun train --resume {out}" in stderr and "Traceback" not in stderr
    stopped_at = int(ckpt.list_checkpoints(out)[-1].name.split("_")[1])
    assert 0 < stopped_at < 12
    resumed = run_speedrun("train", "--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert losses(read_metrics(out)) == losses(read_metrics(straight_run))


def test_interrupted_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg = load_recipe("demo", [*TINY])
    model = GPT(cfg.model)
    good = ckpt.save_checkpoint(tmp_path, 1, model, {"step": 1}, cfg.to_dict(), keep=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def crash(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.os, "replace", crash)  # dies after writing, before the rename
    with pytest.raises(SpeedrunError, match="cannot write checkpoint .*step_000002: No space left on device"):
        ckpt.save_checkpoint(tmp_path, 2, model, {"step": 2}, cfg.to_dict(), keep=2)
    monkeypatch.undo()
    assert ckpt.list_checkpoints(tmp_path) == [good]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))  # the partial write was cleaned up
    fresh = GPT(cfg.model)
    state, _ = ckpt.load_checkpoint(good, fresh)
    assert state["step"] == 1
    torch.testing.assert_close(fresh.lm_head.weight + 1.0, model.lm_head.weight)


def test_a_leftover_tmp_folder_is_not_a_checkpoint(tmp_path):
    cfg = load_recipe("demo", [*TINY])
    model = GPT(cfg.model)
    good = ckpt.save_checkpoint(tmp_path, 3, model, {"step": 3}, cfg.to_dict(), keep=2)
    crashed = tmp_path / "checkpoints" / "step_000006.tmp"  # a process killed mid-write leaves this
    shutil.copytree(good, crashed)
    (crashed / "state.pt").unlink()
    assert ckpt.list_checkpoints(tmp_path) == [good]


def test_retention_keeps_the_newest(tmp_path):
    cfg = load_recipe("demo", [*TINY])
    model = GPT(cfg.model)
    for step in range(1, 6):
        ckpt.save_checkpoint(tmp_path, step, model, {"step": step}, cfg.to_dict(), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000004", "step_000005"]


def test_tied_weights_round_trip(tmp_path):
    cfg = load_recipe("gpt2-baseline", [*TINY, "model.vocab_size=512"])
    model = GPT(cfg.model)
    path = ckpt.save_checkpoint(tmp_path, 1, model, {"step": 1}, cfg.to_dict(), keep=1)
    fresh = GPT(cfg.model)
    ckpt.load_checkpoint(path, fresh)
    assert fresh.wte.weight is fresh.lm_head.weight
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.slow
def test_two_process_save_and_resume_match_the_uninterrupted_run(text_data, tmp_path):
    straight = tmp_path / "straight"
    proc = run_speedrun("train", "--out", str(straight), f"data.dir={text_data}", *RESUMABLE, nproc=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = tmp_path / "resumed"
    rewind(straight, resumed, 6)
    proc = run_speedrun("train", "--resume", str(resumed), nproc=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert losses(read_metrics(resumed)) == losses(read_metrics(straight))
