"""Checkpoints, exact resume, signals and interrupted writes."""

import json
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from speedrun.errors import DataError, SpeedrunError
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from speedrun.train.run import checkpoint as ckpt
from tests.conftest import TINY, TINY_ADAMW, read_metrics, speedrun_command, wait_for_metrics
from tests.e2e import runner
from tests.e2e.runs import RUNS


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


# The runs of tests/e2e/runs.py these tests read: `resumable` (12 fp32 steps on one process, a checkpoint
# every 3: a resumed run must reproduce it bit for bit) and `resumable-2` (the same on 2 gloo processes, in
# the suite's one torchrun launch). Their tests share that launch's pytest-xdist worker: each trains once.
SHARED_RUNS = runner.uses("resumable", "resumable-2")


@pytest.fixture
def straight_run(trained) -> Path:
    """The uninterrupted run, on one process (2 micro-batches accumulated per step)."""
    return trained("resumable").folder


@pytest.fixture
def two_process_run(trained) -> Path:
    """The same run on 2 gloo processes under torchrun (1 micro-batch each per step), in the suite's
    one launch (tests/two_processes.py)."""
    return trained("resumable-2").folder


@pytest.mark.slow
@SHARED_RUNS
@pytest.mark.parametrize("at_step", [3, 6])
def test_resume_reproduces_the_uninterrupted_run_exactly(straight_run, tmp_path, at_step):
    resumed = tmp_path / "resumed"
    rewind(straight_run, resumed, at_step)
    proc = runner.resume(resumed, "train.log_every=2")  # a harmless change is allowed ...
    assert proc.code == 0, proc.stderr
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
@SHARED_RUNS
def test_sigterm_saves_and_resume_finishes_like_the_uninterrupted_run(straight_run, text_data, tmp_path):
    out = tmp_path / "run"
    args = speedrun_command(*runner.command(RUNS["resumable"], out, text_data, "train.checkpoint_every=0"))
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_metrics(out, 4)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert f"resume with: speedrun train --resume {out}" in stderr and "Traceback" not in stderr
    stopped_at = int(ckpt.list_checkpoints(out)[-1].name.split("_")[1])
    assert 0 < stopped_at < 12
    resumed = runner.resume(out)
    assert resumed.code == 0, resumed.stderr
    assert losses(read_metrics(out)) == losses(read_metrics(straight_run))


def test_interrupted_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg = load_recipe("demo", [*TINY])
    model = build_model(cfg.model)
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
    fresh = build_model(cfg.model)
    state, _ = ckpt.load_checkpoint(good, fresh)
    assert state["step"] == 1
    torch.testing.assert_close(fresh.lm_head.weight + 1.0, model.lm_head.weight)


def test_a_leftover_tmp_folder_is_not_a_checkpoint(tmp_path):
    cfg = load_recipe("demo", [*TINY])
    model = build_model(cfg.model)
    good = ckpt.save_checkpoint(tmp_path, 3, model, {"step": 3}, cfg.to_dict(), keep=2)
    crashed = tmp_path / "checkpoints" / "step_000006.tmp"  # a process killed mid-write leaves this
    shutil.copytree(good, crashed)
    (crashed / "state.pt").unlink()
    assert ckpt.list_checkpoints(tmp_path) == [good]


def test_retention_keeps_the_newest(tmp_path):
    cfg = load_recipe("demo", [*TINY])
    model = build_model(cfg.model)
    for step in range(1, 6):
        ckpt.save_checkpoint(tmp_path, step, model, {"step": step}, cfg.to_dict(), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000004", "step_000005"]


def test_tied_weights_round_trip(tmp_path):
    cfg = load_recipe("gpt2-baseline", [*TINY_ADAMW, "model.vocab_size=512"])
    model = build_model(cfg.model)
    path = ckpt.save_checkpoint(tmp_path, 1, model, {"step": 1}, cfg.to_dict(), keep=1)
    fresh = build_model(cfg.model)
    ckpt.load_checkpoint(path, fresh)
    assert fresh.wte.weight is fresh.lm_head.weight
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.slow
@SHARED_RUNS
def test_two_processes_train_exactly_like_one_process_with_accumulation(straight_run, two_process_run):
    """World-size invariance through the whole loop (loader shards, DDP, Muon's distributed update,
    validation, checkpoints). fp32, so the only possible difference is rounding: DDP averages two
    half-batch gradients as (g1 + g2) / 2, one process accumulates g1 / 2 + g2 / 2. Halving is exact
    and a sum of two terms has no order, so the runs agree bit for bit (measured); 1e-6 relative
    leaves room for another BLAS reduction order. (AdamW-only recipes: tests/e2e/test_recipe_matrix.py.)"""
    one, two = read_metrics(straight_run), read_metrics(two_process_run)
    # metrics.jsonl is written once, by rank 0: the same records, no duplicates
    assert [(r["step"], "val_loss" in r) for r in one] == [(r["step"], "val_loss" in r) for r in two]
    for a, b in zip(one, two, strict=True):
        key = "val_loss" if "val_loss" in a else "train_loss"
        assert b[key] == pytest.approx(a[key], rel=1e-6, abs=0), (a, b)
    assert "2 processes x 1 micro-steps" in (two_process_run / "log.txt").read_text()
    assert "1 processes x 2 micro-steps" in (straight_run / "log.txt").read_text()
    # train.compile=off under DDP: the batch line says so (DDP's wrapper was once taken for compilation)
    log = (two_process_run / "log.txt").read_text().splitlines()
    (line,) = [x for x in log if ", compile " in x and not x.startswith(("+", "-", " "))]  # not a code diff
    assert "compile False" in line, line


@pytest.mark.slow
@SHARED_RUNS
def test_saved_on_two_processes_resumes_on_one_like_the_uninterrupted_run(two_process_run, tmp_path):
    """The checkpoint does not depend on the world size (the DDP path; the sharded optimizer's resume
    on 1 and 4 processes is tests/e2e/test_normuon_worlds.py). Resumed in this process: a second torchrun
    launch would cost ~13 s of a 2-core host. Same bound as the 1-vs-2-process test above."""
    resumed = tmp_path / "resumed"
    rewind(two_process_run, resumed, 6)
    proc = runner.resume(resumed)
    assert proc.code == 0, proc.stderr[-2000:]
    after, before = losses(read_metrics(resumed)), losses(read_metrics(two_process_run))
    assert [r[:2] for r in after] == [r[:2] for r in before]
    assert [r[2] for r in after] == pytest.approx([r[2] for r in before], rel=1e-6, abs=0)
    starts = re.findall(r"(\d+) processes x (\d+) micro-steps", (resumed / "log.txt").read_text())
    assert starts == [("2", "1"), ("1", "2")]  # started on two, resumed on one
    # summary.json keeps every start (carried in the checkpoint), so `verify` sees the change of hardware
    kept = json.loads((resumed / "summary.json").read_text())["starts"]
    assert [(s["step"], s["world_size"]) for s in kept] == [(0, 2), (6, 1)]
    from speedrun.tools.results import load_runs
    from speedrun.tools.verify import verify

    (hardware,) = [v for v in verify(load_runs([resumed]), 1, 9.0) if v.rule == "hardware"]
    assert hardware.status == "fails" and "resumed on other hardware: 2 x cpu" in hardware.detail, hardware


@pytest.fixture
def saved(tmp_path):
    """A tiny model with two checkpoints, steps 1 and 2."""
    cfg = load_recipe("demo", [*TINY])
    model = build_model(cfg.model)
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, model, {"step": step, "x": torch.ones(3)}, cfg.to_dict(), 0)
    return tmp_path, cfg


def _flip_last_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # tensor data, not the header: safetensors itself would load it without complaint
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("name", ["model.safetensors", "state.pt", "config.json"])
def test_one_changed_byte_in_any_file_is_refused(saved, name):
    run_dir, cfg = saved
    newest = ckpt.checkpoint_path(run_dir, 2)
    _flip_last_byte(newest / name)
    with pytest.raises(DataError) as info:
        ckpt.load_checkpoint(newest, build_model(cfg.model))
    message = str(info.value)
    assert f"checkpoint {newest} is damaged ({name} does not match its sha256" in message
    # the message names the newest intact checkpoint and the exact command that makes it the newest
    aside = run_dir / "damaged-step_000002"
    assert f"the newest intact one is step_000001: to resume from it, mv {newest} {aside}" in message
    newest.rename(aside)
    assert ckpt.list_checkpoints(run_dir)[-1].name == "step_000001"
    state, _ = ckpt.load_checkpoint(ckpt.list_checkpoints(run_dir)[-1], build_model(cfg.model))
    assert state["step"] == 1


def test_missing_extra_file_and_wrong_step_are_refused(saved):
    run_dir, cfg = saved
    newest = ckpt.checkpoint_path(run_dir, 2)
    (newest / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="unexpected file notes.txt"):
        ckpt.load_checkpoint(newest, build_model(cfg.model))
    (newest / "notes.txt").unlink()
    (newest / "state.pt").unlink()
    with pytest.raises(DataError, match="missing file state.pt"):
        ckpt.load_checkpoint(newest, build_model(cfg.model))
    # the folder renamed to another step: its contents (and manifest) say step 2
    shutil.rmtree(newest)
    moved = ckpt.checkpoint_path(run_dir, 7)
    shutil.copytree(ckpt.checkpoint_path(run_dir, 1), moved)
    with pytest.raises(DataError, match="manifest.json is for step 1, the folder for 7"):
        ckpt.load_checkpoint(moved, build_model(cfg.model))


def test_step_inside_state_must_match_the_folder(saved):
    """Even with a manifest rewritten to match, the step inside state.pt must be the folder's step."""
    import hashlib
    import json

    run_dir, cfg = saved
    newest = ckpt.checkpoint_path(run_dir, 2)
    torch.save({"step": 5, "x": torch.ones(3)}, newest / "state.pt")
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {
        "sha256": hashlib.sha256((newest / "state.pt").read_bytes()).hexdigest(),
        "bytes": (newest / "state.pt").stat().st_size,
    }
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="state.pt holds step 5"):
        ckpt.load_checkpoint(newest, build_model(cfg.model))


def test_a_damaged_only_checkpoint_says_the_run_cannot_resume(tmp_path):
    cfg = load_recipe("demo", [*TINY])
    path = ckpt.save_checkpoint(tmp_path, 3, build_model(cfg.model), {"step": 3}, cfg.to_dict(), 0)
    (path / "manifest.json").unlink()
    advice = f"no older checkpoint is intact; to start the run over from step 0, mv {tmp_path}/checkpoints "
    with pytest.raises(DataError, match=f"manifest.json is missing.*{re.escape(advice)}"):
        ckpt.load_checkpoint(path, build_model(cfg.model))


@pytest.mark.parametrize(
    "target, error",
    [
        (
            "torch.save",
            RuntimeError("[enforce fail at inline_container.cc:626] PytorchStreamWriter failed"),
        ),
        ("save_file", OSError(28, "No space left on device")),
        ("save_file", SafetensorError("Error while serializing: IoError(No space left on device)")),
    ],
)
def test_disk_full_during_a_write_is_one_error_and_leaves_no_tmp(tmp_path, monkeypatch, target, error):
    cfg = load_recipe("demo", [*TINY])
    model = build_model(cfg.model)

    def full(*_args, **_kwargs):
        raise error

    if target == "torch.save":
        monkeypatch.setattr(ckpt.torch, "save", full)
    else:
        monkeypatch.setattr(ckpt, "save_file", full)
    with pytest.raises(SpeedrunError, match=r"cannot write checkpoint .*step_000001: ") as info:
        ckpt.save_checkpoint(tmp_path, 1, model, {"step": 1}, cfg.to_dict(), keep=2)
    assert "\n" not in str(info.value)
    assert not list((tmp_path / "checkpoints").iterdir())  # no .tmp folder, no checkpoint


def test_checkpoint_files_honour_the_umask(tmp_path):
    import os
    import stat

    cfg = load_recipe("demo", [*TINY])
    old = os.umask(0o027)
    try:
        path = ckpt.save_checkpoint(tmp_path, 1, build_model(cfg.model), {"step": 1}, cfg.to_dict(), keep=2)
    finally:
        os.umask(old)
    for f in path.iterdir():  # safetensors alone would make 0600
        assert stat.S_IMODE(f.stat().st_mode) == 0o640, f.name
