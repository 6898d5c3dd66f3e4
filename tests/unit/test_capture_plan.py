"""The CUDA-graph capture plan (speedrun/perf/capture_plan.py) on record-2026-07's stages, against a
brute-force walk over every step of the run: the plan's keys are exactly the configurations the steps
take, each visited twice (capture, then check) at a step that has it, within the rules' 40 warm-up steps."""

from __future__ import annotations

import dataclasses

import pytest

from speedrun.config.stages import stage_plan
from speedrun.perf.capture_plan import MAX_WARMUP_STEPS, capture_plan, key_at
from speedrun.recipes import load_recipe
from speedrun.train.stages import stage_at


def every_step_key(plan, adam_every):
    """(batch, doc cut, windows, Adam step) of each step, read from stage_at: the independent walk."""
    out = {}
    for step in range(plan.total_steps):
        s = plan.stages[stage_at(step, plan)[0]]
        out.setdefault((s.batch_tokens, s.max_doc_len, s.windows, step % adam_every == adam_every - 1), step)
    return out


@pytest.mark.parametrize("adam_every", [1, 2])
def test_record_2026_07_plan_covers_every_configuration_twice_within_40_steps(adam_every):
    cfg = load_recipe("record-2026-07")
    plan = stage_plan(cfg)
    got = capture_plan(plan, adam_every)
    want = every_step_key(plan, adam_every)
    assert [dataclasses.astuple(k) for k in got.keys] == list(want)  # the run's order of first meeting
    for key in got.keys:
        steps = [(s, what) for s, k, what in got.visits if k == key]
        assert [what for _, what in steps] == ["capture", "check"]
        assert all(key_at(plan, s, adam_every) == key for s, _ in steps)
        assert steps[0][0] == want[dataclasses.astuple(key)]  # the first step that has it
    assert got.warmup_steps == 2 * len(want) <= MAX_WARMUP_STEPS
    # record-2026-07: three stages and an extension with its own windows (each its own configuration)
    assert len({(k.batch_tokens, k.max_doc_len, k.windows) for k in got.keys}) == len(plan.stages) == 4
    assert len(got.keys) == 4 * adam_every
    assert got.describe().endswith(f"= {got.warmup_steps} warm-up steps (the rules allow 40)")


def test_a_plan_past_the_warmup_limit_is_refused_and_shared_configurations_share_a_graph():
    cfg = load_recipe("record-2026-07")
    plan = stage_plan(cfg)
    with pytest.raises(ValueError, match="need 16 warm-up steps .* more than the 15"):
        capture_plan(plan, adam_every=2, limit=15)
    last = plan.stages[-1]
    same = dataclasses.replace(
        plan, stages=(*plan.stages[:-1], dataclasses.replace(last, windows=plan.stages[-2].windows))
    )
    shared = capture_plan(same, adam_every=1)
    assert len(shared.keys) == 3 and shared.stages[shared.keys[-1]] == (2, 3)  # stage 3 and the extension
