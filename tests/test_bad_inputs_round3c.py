"""Third round of faults, third part (docs/bad-inputs.md, third table): a run stopped before its first
checkpoint, non-UTF-8 bytes in paths and arguments, copied runs in `compare`."""

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_speedrun
from tests.test_bad_inputs_more import FAST


@pytest.fixture(scope="module")
def uncheckpointed(text_data, tmp_path_factory) -> Path:
    """A finished tiny run that saved no checkpoint (read-only: tests copy it to change it)."""
    out = tmp_path_factory.mktemp("round3c") / "run"
    proc = run_speedrun("train", "--out", str(out), f"data.dir={text_data}", *FAST, "train.val_every=1")
    assert proc.returncode == 0, proc.stderr
    return out


def _losses(run: Path) -> list[tuple]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in records]


# --------------------------------------------------------------- a run stopped before its first checkpoint


def test_resume_of_a_run_stopped_before_its_first_checkpoint_starts_over(uncheckpointed, tmp_path):
    """What a kill (or a double Ctrl-C) at step 2 leaves: records up to step 2, no summary, no checkpoint.
    `--resume` starts it again from step 0 and ends with the uninterrupted run's metrics, each step
    once (before: `no checkpoint in RUN to resume from`, and `--out RUN` refused the folder too)."""
    run = Path(shutil.copytree(uncheckpointed, tmp_path / "run"))
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    killed = [x for x in lines if json.loads(x)["step"] <= 2]
    (run / "metrics.jsonl").write_text("".join(killed) + '{"step": 3, "val_lo')  # and a torn line
    (run / "summary.json").unlink()
    proc = run_speedrun("train", "--resume", str(run))
    assert proc.returncode == 0, proc.stderr
    assert _losses(run) == _losses(uncheckpointed)
    log = (run / "log.txt").read_text()
    assert f"no checkpoint in {run}, so the run starts again from step 0 (the {len(killed)} metrics" in log
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"


def test_resume_of_a_finished_run_without_checkpoints_is_refused(uncheckpointed, tmp_path):
    run = Path(shutil.copytree(uncheckpointed, tmp_path / "run"))
    before = (run / "metrics.jsonl").read_bytes()
    proc = run_speedrun("train", "--resume", str(run))
    assert proc.returncode == 1 and proc.stderr.strip().endswith("already finished (3 of 3 steps)")
    assert (run / "metrics.jsonl").read_bytes() == before
