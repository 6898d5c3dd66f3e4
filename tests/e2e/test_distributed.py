"""A run under torchrun fails as a whole. (World-size invariance of training: tests/e2e/test_checkpoint.py,
which shares its runs with the resume tests, and tests/e2e/test_recipe_matrix.py for every recipe.)"""

import os
import signal
import subprocess

import pytest

from tests.conftest import read_metrics, wait_for_metrics
from tests.e2e import runner


@pytest.mark.slow
def test_a_dying_rank_stops_the_whole_run_instead_of_hanging(text_data, tmp_path):
    out = tmp_path / "run"
    cmd = runner.launch_command("endless-2", out, text_data)
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_metrics(out, 5)  # both ranks are inside the training loop
        workers = subprocess.run(
            ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(workers) == 2, workers
        os.kill(int(workers[-1]), signal.SIGKILL)  # one rank dies without a word
        _, stderr = launcher.communicate(timeout=90)  # the survivor must not hang
    finally:
        launcher.kill()
    assert launcher.returncode != 0
    assert "SIGKILL" in stderr or "Signal 9" in stderr, stderr[-2000:]
    records = read_metrics(out)
    assert records and records[-1]["step"] < 1000000  # it stopped early, it did not finish


@pytest.mark.slow
def test_a_finished_four_process_run_exits_zero_under_load(text_data, tmp_path):
    """issue 46: a 4-process gloo run that printed `done:` could exit non-zero: DDP's reducer and the
    optimizer's collectives outlived destroy_process_group (freed with train()'s frame) and rank 3 aborted in
    gloo's teardown. Now they go first. Two launches with a busy process beside them (the load that showed
    it); each must exit 0 after its `done:` line."""
    import sys

    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for i in range(2):
            out = tmp_path / f"run{i}"
            cmd = runner.launch_command("two-steps-4", out, text_data)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert "done:" in proc.stdout + proc.stderr, proc.stderr[-3000:]
            assert proc.returncode == 0, (i, proc.stderr[-3000:])
    finally:
        burner.kill()
        burner.wait()


@pytest.mark.slow
def test_the_survivor_of_a_killed_rank_says_one_line_with_the_checkpoint_to_resume(text_data, tmp_path):
    """torchrun notices a dead worker only at its monitor interval (5 s by default; 30 s here, as on a busy
    or multi-node launch): the survivor meets the death first, in a collective. It says one line naming the
    collective's error, the newest checkpoint and `--resume` (before: a 24-line gloo traceback)."""
    out = tmp_path / "run"
    cmd = runner.launch_command("endless-2", out, text_data, "train.checkpoint_every=3")
    cmd.insert(cmd.index("--standalone"), "--monitor-interval=30")
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_metrics(out, 5)  # past the step-3 checkpoint
        workers = subprocess.run(
            ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(workers) == 2, workers
        os.kill(int(workers[-1]), signal.SIGKILL)  # rank 1 dies; rank 0 is in (or enters) a collective
        _, stderr = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode != 0
    ours = [line for line in stderr.splitlines() if "speedrun" in line and "error:" in line]
    assert len(ours) == 1, stderr[-3000:]
    assert "another process of this run stopped (" in ours[0], ours
    assert "the newest checkpoint is " in ours[0] and f"resume with: speedrun train --resume {out}" in ours[0]
    assert "[rank0]: Traceback" not in stderr and "RuntimeError" not in stderr, stderr[-3000:]
