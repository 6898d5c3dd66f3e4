"""World-size invariance: 2 gloo processes under torchrun train exactly like 1 process with accumulation."""

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import TINY, read_metrics, run_speedrun, speedrun_command, wait_for_metrics

# fp32, so the only possible differences are floating-point rounding: DDP averages two half-batch
# gradients as (g1 + g2) / 2, one process accumulates g1 / 2 + g2 / 2. Halving is exact in binary
# floating point and a sum of two terms does not depend on order, so in practice the runs agree
# bit for bit (measured: 0 difference); the tolerance of 1e-6 relative (a few fp32 ulps, amplified by
# the optimizer over 8 steps) only leaves room for a different BLAS reduction order on other machines.
# bf16 autocast is off: its rounding would hide real bugs behind noise.
EXACT = [*TINY, "train.dtype=fp32", "train.steps=8", "train.warmdown_steps=4", "train.val_every=4"]


def run(nproc: int, out: Path, data: Path, *extra: str) -> list[dict]:
    proc = run_speedrun("train", "--out", str(out), f"data.dir={data}", *EXACT, *extra, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(out)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_two_processes_match_one_process_with_accumulation(text_data, tmp_path, optimizer):
    one = run(1, tmp_path / "one", text_data, f"optim.name={optimizer}", "optim.lr=3e-3")
    two = run(2, tmp_path / "two", text_data, f"optim.name={optimizer}", "optim.lr=3e-3")
    # metrics.jsonl is written once, by rank 0: the same records, no duplicates
    assert [(r["step"], "val_loss" in r) for r in one] == [(r["step"], "val_loss" in r) for r in two]
    for a, b in zip(one, two, strict=True):
        key = "val_loss" if "val_loss" in a else "train_loss"
        assert b[key] == pytest.approx(a[key], rel=1e-6, abs=0), (a, b)
    log = (tmp_path / "two" / "log.txt").read_text()
    assert "2 processes x 1 micro-steps" in log
    assert "1 processes x 2 micro-steps" in (tmp_path / "one" / "log.txt").read_text()


@pytest.mark.slow
def test_a_dying_rank_stops_the_whole_run_instead_of_hanging(text_data, tmp_path):
    out = tmp_path / "run"
    cmd = speedrun_command(
        "train",
        "--out",
        str(out),
        f"data.dir={text_data}",
        *EXACT,
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
