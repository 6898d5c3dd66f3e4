"""The stage plan against today's record's own `TrainingSchedule` and `get_muon_momentum` (train_gpt.py @
f411b3d3; #89's lines, transcribed once in fidelity/test_record_2026.py and refs/schedules.py), at every
step of the run and at the final validation, for other step counts than the record's."""

from __future__ import annotations

import dataclasses

import pytest

from speedrun.config.stages import Stage, StagePlan
from speedrun.train.stages import stage_values
from tests.fidelity.refs import schedules
from tests.fidelity.test_record_2026 import RecordSchedule
from tests.record_stages import STAGES_2026_07


@pytest.mark.parametrize("scheduled,extension", [(1270, 15), (1380, 10), (31, 4)])
def test_stage_plan_is_todays_record_at_every_step(scheduled, extension):
    plan = dataclasses.replace(STAGES_2026_07, scheduled_steps=scheduled, extension_steps=extension)
    ref = RecordSchedule(scheduled, extension, 0.60)
    seen = set()
    for step in range(ref.total_steps + 1):
        got = stage_values(step, plan)
        stage, t = ref.lookup(step)
        assert got.lr == ref.get_lr(step), step
        assert got.muon_momentum == schedules.muon_momentum(step, ref.total_steps), step
        assert got.batch_tokens == stage[2] and got.max_doc_len == stage[1]
        long = 20 if step == ref.total_steps else stage[3][1]  # apply_final_ws_ext at the last validation
        assert (got.short_window, got.long_window) == (stage[3][0], long)
        assert got.mtp_weights == tuple(a + (b - a) * t for a, b in zip(stage[5], stage[6], strict=True))
        seen.add(got.stage)
    assert seen == {0, 1, 2, 3}


def test_durations_that_do_not_add_up_are_refused():
    bad = StagePlan(
        stages=(Stage(8, 0, (1, 1), 1.0, duration=0.5), Stage(8, 0, (1, 1), 1.0)), scheduled_steps=10
    )
    with pytest.raises(AssertionError):
        stage_values(0, bad)
