"""`anvil-2026-08` (record #92) shrunk but with every switch it sets (tests/recipe_matrix.py `shrink`: ANVIL,
the row-sharded n-gram table, the sampled softmax, mixed widths, the terminal ships), trained through the
CLI on 1 and on 2 gloo processes: the same losses; a checkpoint saved on 2 processes (the ANVIL banks'
sharded state with its uint16 mantissa sidecars, the table's row state) resumes on 1 to the same losses.

The prefix loss and the canonical mask read GPT-2 token ids, which the test dataset (bpe:512) has not: they
are off here (their own tests: tests/test_prefix*.py, tests/test_canonical*.py)."""

from __future__ import annotations

import shutil

import pytest

from speedrun.train.run import checkpoint as ckpt
from tests.e2e import runner
from tests.world_losses import assert_same, losses

# The runs (tests/e2e/runs.py `anvil`, `anvil-2`): the shrunk record with its switches on the bpe:512 data, a
# checkpoint every 4 steps; the 2-process one is a job of the suite's one launch.
SHARED = runner.uses("anvil", "anvil-2")


@pytest.fixture
def runs(trained):
    return {1: trained("anvil").folder, 2: trained("anvil-2").folder}


@pytest.mark.slow
@SHARED
def test_one_and_two_processes_train_the_shrunk_record_alike(runs):
    a, b = losses(runs[1]), losses(runs[2])
    assert a[-1][1] == "val" and len(a) == 11  # ten training losses, one validation (#92's: once, at the end)
    assert_same(a, b)


@pytest.mark.slow
@SHARED
def test_saved_on_two_processes_it_resumes_on_one(runs, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(runs[2], resumed)
    for path in ckpt.list_checkpoints(resumed):
        if ckpt.checkpoint_step(path) > 4:
            shutil.rmtree(path)
    proc = runner.resume(resumed)
    assert proc.code == 0, proc.stderr[-3000:]
    assert_same(losses(runs[2]), losses(resumed), first=5)


def test_too_few_sampled_candidates_for_a_micro_batch_end_in_one_line(text_data, tmp_path):
    """P below a micro-batch's distinct targets is found on the device (a config check cannot know the
    data): the run ends with one line naming the setting and its remedy (before: a 40-line traceback)."""
    few = "train.stages=tokens=512 windows=1/1 frac=1/2 sampled=16; tokens=512 windows=1/2 frac=1/2; " \
          "tokens=512 windows=1/2 ext=0"  # fmt: skip
    proc = runner.execute("anvil", tmp_path / "run", text_data, few)  # the run, with the stages changed
    assert proc.code == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "speedrun: error: a micro-batch has more distinct targets"
    ), lines
    assert "raise sampled= in the stages that sample" in lines[0]
