"""A run under torchrun fails as a whole. (World-size invariance of training: tests/test_checkpoint.py,
which shares its runs with the resume tests, and tests/test_recipe_matrix.py for every recipe.)"""

import os
import signal
import subprocess

import pytest

from tests.conftest import TINY, read_metrics, speedrun_command, wait_for_metrics


@pytest.mark.slow
def test_a_dying_rank_stops_the_whole_run_instead_of_hanging(text_data, tmp_path):
    out = tmp_path / "run"
    cmd = speedrun_command(
        "train",
        "--out",
        str(out),
        f"data.dir={text_data}",
        *TINY,
        "train.steps=1000000",
        "train.warmdown_steps=4",
        "train.val_every=0",
        nproc=2,
    )
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
