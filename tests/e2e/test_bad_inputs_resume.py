"""Bad inputs and faults of --resume: runs stopped early or finished, damaged config or metrics, data changed
under the run (docs/bad-inputs.md): each ends in one stderr line and exit 1 or 2, or works; nothing we do
not own is lost, nothing is silently wrong."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from speedrun.config import Config
from speedrun.errors import DataError
from tests.bad_input_runs import FAST, _losses, copy_run, one_line
from tests.conftest import run_speedrun


def test_resume_never_truncates_what_a_linked_lock_file_points_to(finished, tmp_path):
    run = copy_run(finished, tmp_path / "run")
    (run / ".speedrun.lock").unlink(missing_ok=True)
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's file\n")
    (run / ".speedrun.lock").symlink_to(precious)
    one_line(run_speedrun("train", "--resume", str(run)), 1, ".speedrun.lock: is a symbolic link")
    assert precious.read_text() == "the user's file\n"


def test_resume_given_a_checkpoint_folder_names_the_run(finished, tmp_path):
    run = copy_run(finished, tmp_path / "run")
    ckpt = run / "checkpoints" / "step_000003"
    before = sorted(p.name for p in ckpt.iterdir())
    one_line(run_speedrun("train", "--resume", str(ckpt)), 2, "is a checkpoint of the run", f"--resume {run}")
    assert sorted(p.name for p in ckpt.iterdir()) == before  # no lock, log or metrics written into it


def test_resume_of_a_run_stopped_before_its_first_checkpoint_starts_over(uncheckpointed, tmp_path):
    """What a kill (or a double Ctrl-C) at step 2 leaves: records up to step 2, no summary, no checkpoint.
    `--resume` starts it again from step 0 and ends with the uninterrupted run's metrics, each step
    once (before: `no checkpoint in RUN to resume from`, and `--out RUN` refused the folder too)."""
    run = Path(shutil.copytree(uncheckpointed, tmp_path / "run"))
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    killed = [x for x in lines if json.loads(x)["step"] <= 2]
    (run / "metrics.jsonl").write_text("".join(killed) + '{"step": 3, "val_lo')  # and a torn line
    (run / "summary.json").unlink()
    run_id = json.loads((run / "config.json").read_text())["run_id"]
    proc = run_speedrun("train", "--resume", str(run))
    assert proc.returncode == 0, proc.stderr
    assert _losses(run) == _losses(uncheckpointed)
    assert json.loads((run / "config.json").read_text())["run_id"] == run_id  # the same run, started over
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run)).Reload()  # TensorBoard shows each step once, not both attempts
    assert [e.step for e in events.Scalars("train_loss")] == [1, 2, 3]
    log = (run / "log.txt").read_text()
    assert f"no checkpoint in {run}, so the run starts again from step 0 (the {len(killed)} metrics" in log
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"


def test_resume_of_a_finished_run_without_checkpoints_is_refused(uncheckpointed, tmp_path):
    run = Path(shutil.copytree(uncheckpointed, tmp_path / "run"))
    before = (run / "metrics.jsonl").read_bytes()
    proc = run_speedrun("train", "--resume", str(run))
    assert proc.returncode == 1 and proc.stderr.strip().endswith("already finished (3 of 3 steps)")
    assert (run / "metrics.jsonl").read_bytes() == before


def test_resume_of_a_run_whose_config_json_is_a_fifo_is_refused_not_waited_on(uncheckpointed, tmp_path):
    """(Before: reading the named pipe waited forever for a writer; compare and eval check is_file.)"""
    import threading

    run = Path(shutil.copytree(uncheckpointed, tmp_path / "run"))
    (run / "config.json").unlink()
    os.mkfifo(run / "config.json")
    done: list = []
    thread = threading.Thread(
        target=lambda: done.append(run_speedrun("train", "--resume", str(run))), daemon=True
    )
    thread.start()
    thread.join(timeout=30)
    assert done, "--resume waited on the FIFO"
    line = (
        f"speedrun: error: {run / 'config.json'}: is a named pipe (FIFO), not a regular file; not reading it"
    )
    assert done[0].returncode == 1 and done[0].stderr == line + "\n"


def test_resume_names_a_damaged_config_json(tmp_path):
    config = Config().to_dict()
    config["model"]["n_layer"] = "abc"
    (tmp_path / "config.json").write_text(json.dumps(config))
    one_line(run_speedrun("train", "--resume", str(tmp_path)), 2, "config.json is unusable", "model.n_layer")


def test_resume_refuses_shards_prepared_again_under_the_same_names(tmp_path):
    """A data folder prepared again (other text, or another BPE of the same size) keeps its shard
    names; the loader state of a checkpoint only named them, so a resume trained on other token ids."""
    from speedrun.data.loader import TokenLoader
    from speedrun.data.shards import write_shard

    shard = tmp_path / "text-docs_train_000000.bin"
    rng = np.random.default_rng(0)
    write_shard(shard, rng.integers(0, 512, 5000))
    loader = TokenLoader([shard], 1024, 512, 64)
    loader.next_batch()
    state = loader.state_dict()
    TokenLoader([shard], 1024, 512, 64).load_state_dict(state)  # the same data resumes
    write_shard(shard, rng.integers(0, 512, 5000))  # same name, same length, other tokens
    with pytest.raises(DataError, match="changed since the checkpoint was saved"):
        TokenLoader([shard], 1024, 512, 64).load_state_dict(state)


@pytest.mark.parametrize("damage", ["emptied", "removed"])
def test_resume_refuses_a_metrics_history_that_lost_its_records(resumable, damage):
    """The resumed run appended steps 4..6 to an empty file: a history that starts mid-run."""
    metrics = resumable / "metrics.jsonl"
    metrics.write_text("") if damage == "emptied" else metrics.unlink()
    one_line(run_speedrun("train", "--resume", str(resumable)), 1, "no record of step 3")
    assert not metrics.exists() or metrics.read_text() == ""  # not written to


def test_resume_still_continues_an_intact_history(resumable):
    before = [json.loads(line) for line in (resumable / "metrics.jsonl").read_text().splitlines()]
    proc = run_speedrun("train", "--resume", str(resumable))
    assert proc.returncode == 0, proc.stderr
    after = [json.loads(line) for line in (resumable / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in after if "train_loss" in r][-1] == 6
    kept = [r for r in before if r["step"] < 3 or (r["step"] == 3 and "val_loss" not in r)]
    assert after[: len(kept)] == kept  # the history up to the checkpoint is kept as it was


def test_resume_names_the_data_a_run_trained_on_and_takes_a_moved_copy_of_it(text_data, tmp_path):
    """A run started with a relative data.dir, resumed from another folder: one line naming the folder it
    trained on and the remedy (before: the relative folder was looked up under the new folder, and a default
    one prepared again). data.dir= a moved copy of the same data resumes to the uninterrupted run's losses
    (before: refused, data.dir could not change); data.dir= other data is refused, naming the fingerprints."""
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir(), elsewhere.mkdir()
    shutil.copytree(text_data, start / "shards")
    run = tmp_path / "run"
    steps = ["train.steps=6", "train.checkpoint_every=3", "train.checkpoint_keep=0"]
    proc = run_speedrun("train", "--out", str(run), "data.dir=shards", *FAST, *steps, cwd=start)
    assert proc.returncode == 0, proc.stderr
    straight = _losses(run)
    shutil.rmtree(run / "checkpoints" / "step_000006")
    one_line(
        run_speedrun("train", "--resume", str(run), cwd=elsewhere),
        1,
        f"shards (from {elsewhere}) holds no prepared data",
        f"this run trained on {start / 'shards'} (meta sha256 ",
        "resume from the folder the run started in, or add data.dir=FOLDER",
    )
    other = tmp_path / "other"
    shutil.copytree(text_data, other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "note": "prepared again"}))  # another fingerprint
    one_line(
        run_speedrun("train", "--resume", str(run), f"data.dir={other}", cwd=elsewhere),
        1,
        "holds other data than this run trained on",
    )
    moved = Path(shutil.move(start / "shards", tmp_path / "moved"))
    proc = run_speedrun("train", "--resume", str(run), f"data.dir={moved}", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert _losses(run) == straight
