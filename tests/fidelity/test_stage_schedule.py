"""The stage plan against today's record's own `TrainingSchedule` and `get_muon_momentum`, written here
from its code (train_gpt.py @ f411b3d3), at every step of the run and at the final validation."""

from __future__ import annotations

import dataclasses
from itertools import accumulate, pairwise

import pytest

from speedrun.config.stages import Stage, StagePlan
from speedrun.train.stages import stage_values
from tests.record_stages import STAGES_2026_07

RECORD_STAGES = [  # (duration, max_seq_len, batch, windows, lr_mul, mtp start, mtp end)
    (1 / 3, 896, 8 * 2048 * 8, (1, 3), 1.0, [1.0, 0.5, 0.25], [1.0, 0.5, 0.0]),
    (1 / 3, 2048, 16 * 2048 * 8, (3, 7), 1.52, [1.0, 0.5], [1.0, 0.0]),
    (1 / 3, 2048, 24 * 2048 * 8, (5, 11), 1.73, [1.0], [1.0]),
    (None, 2048, 24 * 2048 * 8, (6, 13), 1.0, [1.0], [1.0]),
]


class RecordSchedule:
    def __init__(self, stages, scheduled, extension, cooldown_frac, split_embed_stage=2):
        self.stages, self.scheduled, self.cooldown_frac = stages, scheduled, cooldown_frac
        self.total_steps = scheduled + extension
        ends = [0, *[round(c * scheduled) for c in accumulate(s[0] for s in stages[:-1])], self.total_steps]
        assert scheduled == ends[-2]
        self.boundaries = list(pairwise(ends))
        self.split_step = self.boundaries[split_embed_stage][0] | 1

    def lookup(self, step):
        for i, (start, end) in enumerate(self.boundaries):
            if step < end:
                return self.stages[i], (step - start) / (end - start)
        return self.stages[-1], 1.0

    def get_lr(self, step):
        stage, _ = self.lookup(step)
        lr = stage[4]
        cd_start = int(self.scheduled * (1 - self.cooldown_frac))
        if step >= cd_start:
            t = min(1.0, (step - cd_start) / (self.scheduled - cd_start))
            lr = lr * (1 - t) + 0.15 * t
        return lr


def record_momentum(step, total, warmup=300, cooldown=50, lo=0.85, hi=0.95):
    cd_start = total - cooldown
    if step < warmup:
        return lo + step / warmup * (hi - lo)
    if step > cd_start:
        return hi - (step - cd_start) / cooldown * (hi - lo)
    return hi


@pytest.mark.parametrize("scheduled,extension", [(1270, 15), (1380, 10), (31, 4)])
def test_stage_plan_is_todays_record_at_every_step(scheduled, extension):
    plan = dataclasses.replace(STAGES_2026_07, scheduled_steps=scheduled, extension_steps=extension)
    ref = RecordSchedule(RECORD_STAGES, scheduled, extension, 0.60)
    seen = set()
    for step in range(ref.total_steps + 1):
        got = stage_values(step, plan)
        stage, t = ref.lookup(step)
        assert got.lr == ref.get_lr(step), step
        assert got.muon_momentum == record_momentum(step, ref.total_steps), step
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
