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
import subprocess
from pathlib import Path

import pytest

from speedrun.train.run import checkpoint as ckpt
from tests import two_processes
from tests.conftest import TINY, run_speedrun, speedrun_command
from tests.world_losses import assert_same, losses

SETTINGS = [
    *TINY,
    "train.dtype=fp32",
    "train.micro_batch_tokens=256",  # 4 sequences of 64 per step: 4 x 1, 2 x 2 or 1 x 4 micro-batches
    "train.global_batch_tokens=1024",
    "train.steps=12",
    "train.warmdown_steps=4",
    "train.val_every=4",
    "train.checkpoint_every=3",
    "train.checkpoint_keep=0",
    "optim.muon_momentum_warmup_steps=4",
    "optim.muon_momentum_cooldown_steps=3",
    "optim.tie_until=8",
    "optim.embed_lr=0.02",
    "optim.head_lr=0.02",
    "optim.muon_qk_block_heads=1",  # per-head Q/K blocks (#80 pairs; TINY has 2 heads): a second bank
    "optim.mlp_proj_lr_mul=2.0",  # HEAD's per-matrix multiplier
]


SHARED = two_processes.SHARED  # the 2-process run is a job of the suite's one launch


def state_bytes(run: Path) -> int:
    """The optimizer state per process of the run's latest start (a resumed run's log holds each start)."""
    found = re.findall(r"optimizer state ([\d,]+) bytes per process", (run / "log.txt").read_text())
    assert found, "the log names the optimizer state per process"
    return int(found[-1].replace(",", ""))


def launch(*args: str, nproc: int) -> subprocess.CompletedProcess:
    """run_speedrun, with a longer limit for torchrun: on a loaded 2-core host, 4 processes start up
    (imports, the MFU matmul-peak measurement) in about 400 s."""
    if not nproc:
        return run_speedrun(*args)
    return subprocess.run(speedrun_command(*args, nproc=nproc), capture_output=True, text=True, timeout=1500)


TRAIN = ("--recipe", "demo-normuon")
two_processes.job("normuon-worlds", lambda data: [*TRAIN, f"data.dir={data}", *SETTINGS])


@pytest.fixture(scope="module")
def runs(text_data, tmp_path_factory) -> dict[int, Path]:
    """The run on one process (in this one) and on two (in the suite's one torchrun launch)."""
    one = tmp_path_factory.mktemp("normuon") / "w0"
    proc = run_speedrun("train", *TRAIN, "--out", str(one), f"data.dir={text_data}", *SETTINGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {0: one, 2: two_processes.run_dir("normuon-worlds", text_data, tmp_path_factory)}


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
    proc = launch("train", "--resume", str(resumed), nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same(losses(runs[2]), losses(resumed), first=4)
    if nproc == 4:
        assert state_bytes(resumed) < 0.35 * state_bytes(runs[0])  # each of 4 ranks holds about 1/4
