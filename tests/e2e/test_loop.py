"""The training loop's own behaviours: batch split over processes, checks before step 0, finishing a
run whose final validation was lost, and the timing a resumed run reports."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from speedrun.cli import main
from speedrun.data.shards import open_shard, write_shard
from speedrun.errors import ConfigError
from speedrun.recipes import load_recipe
from speedrun.train.plan.run_data import micro_batch_tokens
from speedrun.train.timing import StepClock
from tests.conftest import TINY, read_metrics
from tests.e2e import runner

FAST = [*TINY, "train.steps=4", "train.warmdown_steps=1", "train.val_every=0"]


def test_micro_batch_is_derived_when_the_recipes_does_not_divide_over_the_processes():
    cfg = load_recipe("demo")  # 8,192 tokens per step in one micro-batch of 32 x 256
    assert micro_batch_tokens(cfg, 1) == 8192
    assert micro_batch_tokens(cfg, 2) == 4096  # torchrun --nproc_per_node=2: 16 sequences each
    assert micro_batch_tokens(cfg, 8) == 1024
    assert micro_batch_tokens(load_recipe("demo", ["train.micro_batch_tokens=2048"]), 2) == 2048
    for world in (3, 64):  # 32 sequences cannot be shared by 3 processes, nor one each by 64
        with pytest.raises(ConfigError, match=f"cannot be split over {world} processes"):
            micro_batch_tokens(cfg, world)
    # validation tokens split the same way: 3 sequences of val_tokens do not share over 2 processes
    three = load_recipe("demo", ["train.val_tokens=768"])
    assert micro_batch_tokens(load_recipe("demo", ["train.val_tokens=1024"]), 2) == 512
    with pytest.raises(ConfigError, match=r"cannot be split over 2 processes .* train.val_tokens \(768\)"):
        micro_batch_tokens(three, 2)


@pytest.mark.parametrize("recipe", ["stages-2025-12", "banks-2026-01", "xsa-2026-04", "record-2026-07"])
def test_a_recipe_with_its_own_validation_rows_keeps_its_micro_batch_on_1_and_8_processes(recipe):
    """The 2025-26 records validate in train.val_seq_len rows (262,144 tokens; 10,485,760 = 5 rounds of 8
    ranks), so their 49,152-token training micro-batch need not divide val_tokens: as the records run."""
    from speedrun.train.plan.run_data import val_micro_batch_tokens

    cfg = load_recipe(recipe)
    assert cfg.train.val_seq_len and cfg.train.val_tokens % cfg.train.micro_batch_tokens  # the case
    for world in (1, 8):
        assert micro_batch_tokens(cfg, world) == cfg.train.micro_batch_tokens == 49152
        assert val_micro_batch_tokens(cfg, world, 49152) == cfg.train.val_seq_len


def test_damaged_validation_data_fails_before_the_first_step(text_data, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(text_data, data)
    shard = sorted(data.glob("*_val_*.bin"))[0]
    tokens = np.array(open_shard(shard))
    tokens[1500] = 600  # inside the 2,048 validation tokens, beyond the 512-token vocabulary
    write_shard(shard, tokens)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), f"data.dir={data}", *FAST]) == 1
    assert "600" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists() or read_metrics(out) == []  # no step was trained


def test_resume_finishes_a_run_killed_during_its_final_validation(text_data, tmp_path):
    out = tmp_path / "run"
    assert runner.execute("four-steps", out, text_data).code == 0
    complete = read_metrics(out)
    assert "val_loss" in complete[-1] and complete[-1]["step"] == 4
    metrics = out / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in complete[:-1]))  # killed before it was written
    assert runner.resume(out).code == 0
    assert read_metrics(out) == complete[:-1] + [{**complete[-1], "time_s": read_metrics(out)[-1]["time_s"]}]
    assert read_metrics(out)[-1]["val_loss"] == complete[-1]["val_loss"]
    assert runner.resume(out).code == 1  # now it is finished


def test_clock_counts_only_timed_intervals_and_survives_a_resume():
    import torch

    clock = StepClock(torch.device("cpu"))
    clock.start()
    clock.stop(steps=3, timed=False)  # warm-up interval (compilation): not counted
    clock.start()
    seconds = clock.stop(steps=4, timed=True)
    assert clock.timed_steps == 4 and clock.timed_s == seconds > 0
    resumed = StepClock(torch.device("cpu"))
    resumed.load_state_dict(clock.state_dict())
    # the ETA after a resume divides the saved time by the saved number of steps (it used to divide
    # the whole run's time by the steps since the resume, and showed hours for minutes left)
    assert resumed.mean_step_s() == clock.timed_s / 4


@pytest.mark.slow
@runner.uses("demo-2")
def test_demo_trains_under_torchrun_with_two_processes_without_overrides(trained):
    """The demo's micro-batch (the whole global batch) is split over 2 processes (runs.py `demo-2`, in
    tests/two_processes.py's launch)."""
    out = trained("demo-2").folder
    assert "2 processes x 1 micro-steps x 512 tokens" in (out / "log.txt").read_text()
    assert Path(out / "config.json").exists()
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2  # what `verify` compares


def test_a_compiler_failure_is_one_line_naming_the_setting_that_avoids_it():
    import torch._dynamo

    from speedrun.errors import SpeedrunError
    from speedrun.train.loop import compile_errors

    message = r"torch.compile failed \(no C\+\+ compiler\); run with train.compile=off"
    with pytest.raises(SpeedrunError, match=message), compile_errors(compiled=True):
        raise torch._dynamo.exc.TorchDynamoException("no C++ compiler\nlong details")
    with pytest.raises(torch._dynamo.exc.TorchDynamoException), compile_errors(compiled=False):
        raise torch._dynamo.exc.TorchDynamoException("an eager run: not ours to explain")
    with pytest.raises(ValueError), compile_errors(compiled=True):  # anything else passes through
        raise ValueError("x")
