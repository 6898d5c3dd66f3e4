"""Faults a user meets: a full or read-only disk, and a run killed at any point of its writes.

The disk tests use a real tiny tmpfs where the machine allows mounting one (root), and a
monkeypatched failing write everywhere. The fault-injection test kills training (in process, at
the N-th write call, leaving a half-written line or file as a real kill would; plus real SIGKILLs)
and proves that `--resume` always finishes with exactly the metrics of an uninterrupted run.
"""

import errno
import os
import random
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from speedrun.cli import main
from speedrun.train.run import checkpoint as ckpt
from speedrun.train.run import rundir
from tests.conftest import TINY, read_metrics, run_speedrun, speedrun_command, wait_for_metrics
from tests.e2e import runner
from tests.e2e.runs import RUNS
from tests.e2e.test_checkpoint import losses


@pytest.fixture
def tiny_fs(tmp_path):
    """mount(size, ro=False) -> a fresh tmpfs of `size` bytes under tmp_path; unmounted afterwards."""
    mounts = []

    def mount(size: int, ro: bool = False) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        path = tmp_path / f"fs{len(mounts)}"
        path.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)]).returncode:
            pytest.skip("this machine does not allow mounting a tmpfs")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)])


def _one_error_line(capsys, code: int, rc: int, *fragments: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == code and len(err) == 1 and err[0].startswith("speedrun: error:"), (rc, err)
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])


@pytest.fixture
def small_text(tmp_path) -> Path:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(f'{{"text": "document {i} {"word " * 40}"}}\n' for i in range(400)))
    return src


@pytest.mark.parametrize("ro", [True, False])
def test_prepare_on_a_read_only_or_full_disk(tiny_fs, small_text, capsys, ro):
    fs = tiny_fs(32 * 1024, ro=ro)
    rc = main(["prepare", f"text:{small_text}", "--tokenizer", "bpe:300", "--data-dir", str(fs / "data")])
    why = "Read-only file system" if ro else "No space left on device"
    _one_error_line(capsys, 1, rc, f"cannot write {fs}", why)
    assert list(fs.iterdir()) == []  # no partial folder, complete-looking or not


def test_prepare_when_a_write_fails_leaves_nothing(small_text, tmp_path, capsys, monkeypatch):
    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # every finished file is fsynced before it is renamed
    rc = main(["prepare", f"text:{small_text}", "--tokenizer", "bpe:300", "--data-dir", str(tmp_path / "d")])
    _one_error_line(capsys, 1, rc, "cannot write", "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]


@pytest.mark.slow
def test_training_on_a_disk_that_fills(tiny_fs, text_data):
    """A real ENOSPC: torch.save raises RuntimeError, safetensors its own error: one line either way."""
    fs = tiny_fs(400 * 1024)
    out = fs / "run"
    proc = run_speedrun(
        "train", "--out", str(out), f"data.dir={text_data}", *TINY, "train.steps=4", "train.warmdown_steps=1",
        "train.checkpoint_every=1",
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"speedrun: error: cannot write checkpoint {out}/checkpoints/step_000001")
    assert not list((out / "checkpoints").glob("*.tmp"))


# ------------------------------------------------------------------------------------ kill and resume

# the run killed and resumed: runs.py `killable` (9 fp32 steps, a checkpoint every 2, none at the last step)


class Killed(BaseException):
    """Stands for SIGKILL: no `except Exception` handler sees it, no write is cleaned up or completed."""


def _inject(monkeypatch, kill_at: int, hits: list[str]) -> None:
    """Make the `kill_at`-th write of the run (metrics, log, checkpoint files, renames) its last;
    append the kind of write it hit to `hits`."""
    calls = {"n": 0}

    def tick(kind: str) -> None:
        calls["n"] += 1
        if calls["n"] == kill_at:
            hits.append(kind)
            raise Killed(kill_at)

    real_write, real_replace = os.write, os.replace
    real_save_file, real_torch_save, real_fsync = ckpt.save_file, torch.save, ckpt._fsync

    def write(fd, data):
        if calls["n"] + 1 == kill_at:  # a torn line, as a kill in the middle of write() leaves
            real_write(fd, bytes(data)[: max(1, len(data) // 2)])
        tick("line")
        return real_write(fd, data)

    def wrap(real, kind):
        def patched(*args, **kwargs):
            tick(kind)
            return real(*args, **kwargs)

        return patched

    monkeypatch.setattr(rundir.os, "write", write)  # rundir.os is os: also the lock file's pid
    monkeypatch.setattr(os, "replace", wrap(real_replace, "rename"))
    monkeypatch.setattr(ckpt, "save_file", wrap(real_save_file, "checkpoint"))
    monkeypatch.setattr(torch, "save", wrap(real_torch_save, "checkpoint"))
    monkeypatch.setattr(ckpt, "_fsync", wrap(real_fsync, "checkpoint"))


def _train(cfg, out: Path, resume: bool) -> None:
    from speedrun.train.loop import train

    train(cfg, out, resume=resume)


# the two kill tests share the uninterrupted run: one pytest-xdist worker trains it once
STRAIGHT = runner.uses("killable")


@pytest.fixture
def straight_losses(trained) -> list[tuple]:
    """The losses of the uninterrupted run (`speedrun train`, runs.py `killable`)."""
    return losses(trained("killable").metrics)


@pytest.mark.slow
@STRAIGHT
def test_killed_at_random_writes_resume_always_matches_the_uninterrupted_run(
    text_data, tmp_path, capsys, straight_losses
):
    cfg = runner.config("killable", text_data)

    # which kinds of write the kills hit depends on how many writes a segment makes: a new log line can
    # shift them (seed 11 stopped reaching a rename when the speed layer's two lines came, so 13)
    rng = random.Random(13)
    out, started, hits = tmp_path / "run", False, []
    for _attempt in range(40):
        with pytest.MonkeyPatch.context() as mp:
            _inject(mp, rng.randint(1, 30), hits)  # a segment makes ~8 writes, then ~13 per checkpoint
            try:
                _train(cfg, out, resume=started)
                break
            except Killed:
                pass
        # resumable once config.json is written; killed before the first checkpoint, it starts over
        started = (out / "config.json").exists()
    else:
        pytest.fail("the run never finished")
    capsys.readouterr()
    assert len(hits) >= 5 and {"line", "checkpoint", "rename"} <= set(hits), hits
    assert losses(read_metrics(out)) == straight_losses  # every record, bit for bit, each exactly once
    assert not list((out / "checkpoints").glob("*.tmp"))
    assert "starts again from step 0" in (out / "log.txt").read_text()  # kills before the first checkpoint


@pytest.mark.slow
@STRAIGHT
def test_real_sigkills_during_writes_then_resume(text_data, tmp_path, straight_losses):
    out = tmp_path / "run"
    args = runner.command(RUNS["killable"], out, text_data)
    proc = subprocess.Popen(speedrun_command(*args), stdout=subprocess.DEVNULL)
    wait_for_metrics(out, 4)  # inside the loop
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = subprocess.Popen(speedrun_command("train", "--resume", str(out)), stdout=subprocess.DEVNULL)
    wait_for_metrics(out, 9)
    os.kill(resumed.pid, signal.SIGKILL)  # the resumed run is killed too, wherever it is
    resumed.wait()
    final = run_speedrun("train", "--resume", str(out))  # no checkpoint at the last step: always resumable
    assert final.returncode == 0, final.stderr
    assert losses(read_metrics(out)) == straight_losses
