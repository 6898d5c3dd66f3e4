"""The 2025–26 optimizer (optim.name=normuon, recipe demo-normuon) through the whole loop on 1, 2 and
4 gloo processes: the same losses, and checkpoints that resume on another number of processes.

Every new switch is on: NorMuon with Polar Express and cautious decay, momentum warm-up and cool-down,
Q/K orthogonalized per head, a per-matrix LR multiplier, Adam every other step (so a checkpoint at an
odd step carries kept gradients), tied embedding and head untied mid-run. Sharding is visible in the
log: each rank holds 1/W of the optimizer state.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from speedrun.train.run import checkpoint as ckpt
from tests.e2e import runner
from tests.world_losses import assert_same, losses

# The runs (tests/e2e/runs.py `normuon`, `normuon-2`): demo-normuon with every new switch on, 12 fp32 steps
# of 4 sequences (4 x 1, 2 x 2 or 1 x 4 micro-batches), a checkpoint every 3 steps; the 2-process one is a
# job of the suite's one launch.
SHARED = runner.uses("normuon", "normuon-2")


def state_bytes(run: Path) -> int:
    """The optimizer state per process of the run's latest start (a resumed run's log holds each start)."""
    found = re.findall(r"optimizer state ([\d,]+) bytes per process", (run / "log.txt").read_text())
    assert found, "the log names the optimizer state per process"
    return int(found[-1].replace(",", ""))


@pytest.fixture
def runs(trained) -> dict[int, Path]:
    """The run on one process (in this one) and on two (in the suite's one torchrun launch)."""
    return {0: trained("normuon").folder, 2: trained("normuon-2").folder}


@pytest.mark.slow
@SHARED
def test_one_and_two_processes_train_alike_with_sharded_state(runs):
    assert_same(losses(runs[0]), losses(runs[2]))
    assert state_bytes(runs[2]) < 0.6 * state_bytes(runs[0])  # sharded, not replicated


@pytest.mark.slow
@SHARED
@pytest.mark.parametrize("nproc", [0, 4])
def test_saved_on_two_resumes_on_one_and_four(runs, nproc, tmp_path):
    """Step 3: tied, and Adam skipped step 2, so its kept gradients travel in the checkpoint. Four
    processes are proven here only: steps 4-12 on 4 equal those on 2, which equal those on 1 (a
    from-scratch run on 4 would add a launch, ~25 s of a 2-core host, and no code path)."""
    resumed = tmp_path / "resumed"
    shutil.copytree(runs[2], resumed)
    for path in ckpt.list_checkpoints(resumed):
        if ckpt.checkpoint_step(path) > 3:
            shutil.rmtree(path)
    proc = runner.resume(resumed, processes=max(nproc, 1))
    assert proc.code == 0, proc.stderr[-3000:]
    assert_same(losses(runs[2]), losses(resumed), first=4)
    if nproc == 4:
        assert state_bytes(resumed) < 0.35 * state_bytes(runs[0])  # each of 4 ranks holds about 1/4
