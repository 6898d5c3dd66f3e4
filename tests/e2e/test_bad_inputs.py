"""The bad-input catalogue (docs/bad-inputs.md): each row's message and exit code, one line, no traceback.

Every case runs the real CLI in a subprocess, as a user would.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from speedrun.data.shards import write_shard
from tests.conftest import TINY, run_speedrun

FAST = [*TINY, "train.steps=3", "train.warmdown_steps=1", "train.val_every=0"]


def assert_one_line(proc: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speedrun: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def train(data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_speedrun("train", "--out", str(out), f"data.dir={data}", *FAST, *extra)


def test_empty_data_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line(
        train(tmp_path / "empty", tmp_path / "run"), 1, str(tmp_path / "empty"), "speedrun prepare"
    )


def test_missing_shard(data_copy, tmp_path):
    shard = sorted(data_copy.glob("*_train_*.bin"))[0]
    shard.unlink()
    assert_one_line(train(data_copy, tmp_path / "run"), 1, shard.name)


def test_shard_with_bad_magic(data_copy, tmp_path):
    shard = sorted(data_copy.glob("*_val_*.bin"))[0]
    raw = bytearray(shard.read_bytes())
    raw[0:4] = (12345).to_bytes(4, "little")
    shard.write_bytes(bytes(raw))
    assert_one_line(train(data_copy, tmp_path / "run"), 1, shard.name, "magic")


def test_shard_with_token_ids_beyond_the_vocab(data_copy, tmp_path):
    shard = sorted(data_copy.glob("*_train_*.bin"))[0]
    import numpy as np

    from speedrun.data.shards import open_shard

    tokens = np.array(open_shard(shard))
    tokens[5] = 600  # the data claims a 512-token vocabulary
    write_shard(shard, tokens)
    assert_one_line(train(data_copy, tmp_path / "run"), 1, shard.name, "600")


def test_corrupt_meta_json(data_copy, tmp_path):
    (data_copy / "meta.json").write_text("{not json")
    assert_one_line(train(data_copy, tmp_path / "run"), 1, "meta.json")


def test_data_smaller_than_one_batch(text_data, tmp_path):
    proc = train(
        text_data, tmp_path / "run", "train.global_batch_tokens=67108864", "train.micro_batch_tokens=512"
    )
    assert_one_line(proc, 1, "67108864")


def test_output_folder_that_cannot_be_created(text_data, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert_one_line(train(text_data, blocker / "run"), 1, "cannot write run directory", str(blocker / "run"))


def test_output_folder_that_already_holds_a_run(text_data, tmp_path):
    out = tmp_path / "run"
    assert train(text_data, out).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert_one_line(train(text_data, out), 2, "already holds a run", f"--resume {out}")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing touched


def test_output_folder_with_the_users_files_is_not_touched(text_data, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text('{"my": "own config"}')
    (out / "log.txt").write_text("my notes\n")
    assert_one_line(train(text_data, out), 2, f"--out {out} is not empty (holds config.json, log.txt)")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "log.txt"]
    assert (out / "log.txt").read_text() == "my notes\n"
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_one_line(train(text_data, afile), 2, "is a file, not a folder")


def test_a_run_directory_in_use_is_refused(finished_run):
    """A second process (here: a --resume while another process holds the run) gets one line."""
    import sys
    import time

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(finished_run / '.speedrun.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'4242'); print('locked', flush=True)\n"
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = (finished_run / "metrics.jsonl").read_bytes()
        start = time.time()
        proc = run_speedrun("train", "--resume", str(finished_run))
        assert_one_line(proc, 1, f"run directory {finished_run} is in use by another speedrun process")
        assert time.time() - start < 60  # refused at once, not after waiting for the lock
        assert (finished_run / "metrics.jsonl").read_bytes() == before
    finally:
        holder.kill()
        holder.wait()


def test_training_that_diverges_keeps_the_last_good_checkpoint(text_data, tmp_path):
    out = tmp_path / "run"
    proc = train(
        text_data,
        out,
        "train.steps=10",
        "optim.muon_lr=1e30",
        "optim.embed_lr=1e30",
        "train.checkpoint_every=1",
        "train.checkpoint_keep=0",
    )
    assert_one_line(proc, 1, "training loss is nan at step", "diverged")
    bad_step = int(proc.stderr.split("at step ")[1].split(":")[0])
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved[-1] == f"step_{bad_step - 1:06d}"  # nothing written for the poisoned step


@pytest.fixture
def finished_run(finished, tmp_path) -> Path:
    """A copy (to damage) of the finished 3-step run with its last checkpoint (runs.py `finished`)."""
    return shutil.copytree(finished, tmp_path / "finished")


def test_resume_of_a_finished_run(finished_run):
    assert_one_line(
        run_speedrun("train", "--resume", str(finished_run)), 1, "already finished (3 of 3 steps)"
    )


def test_resume_with_a_damaged_checkpoint(finished_run):
    weights = finished_run / "checkpoints" / "step_000003" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert_one_line(run_speedrun("train", "--resume", str(finished_run)), 1, "damaged", "step_000003")


def test_resume_with_a_changed_model(finished_run):
    proc = run_speedrun("train", "--resume", str(finished_run), "model.n_layer=3")
    assert_one_line(proc, 2, "cannot resume with model.n_layer changed (2 -> 3)")


def test_resume_of_a_folder_that_is_not_a_run(tmp_path):
    assert_one_line(run_speedrun("train", "--resume", str(tmp_path)), 2, "not a run directory")


def test_resume_without_checkpoints(text_data, tmp_path):
    out = tmp_path / "run"
    assert train(text_data, out).returncode == 0  # finished; one stopped early starts over (round3c)
    assert_one_line(run_speedrun("train", "--resume", str(out)), 1, "already finished (3 of 3 steps)")


def test_checkpoint_from_another_recipe_is_refused(finished_run, tmp_path):
    config = json.loads((finished_run / "config.json").read_text())
    # the run's config now disagrees with the (intact) checkpoint's
    (finished_run / "config.json").write_text(
        json.dumps({**config, "train": {**config["train"], "steps": 6}})
    )
    proc = run_speedrun("train", "--resume", str(finished_run))
    assert_one_line(proc, 1, "was made with train.steps=3, this run has 6")


def test_more_processes_than_gpus(monkeypatch):
    import torch

    from speedrun.errors import ConfigError
    from speedrun.train import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="local rank 3 has no GPU: this machine has 2"):
        distributed._pick_device("auto", local_rank=3)
