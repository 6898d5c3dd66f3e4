"""Per-step schedules (LR, Muon momentum, attention window) against the record scripts' formulas."""

import math

import pytest

from speedrun.config import OptimConfig, TrainConfig
from speedrun.config.stages import stage_plan
from speedrun.recipes import load_recipe, recipe_names
from speedrun.train.schedule import lr_multiplier, muon_momentum, schedule_at


def record_trapezoid(it: int, steps: int, warmup: int, warmdown: int) -> float:
    """get_lr of the 2024-10 … 2024-12 record scripts, written as they write it."""
    if it < warmup:
        return (it + 1) / warmup
    if it < steps - warmdown:
        return 1.0
    return (steps - it) / warmdown


def sub3min_lr(step: int, steps: int, cooldown_frac: float = 0.4, floor: float = 0.1) -> float:
    """get_lr of the 2025-01-16 (Sub3Min) record script (2025-07 BOS-align: cool-down 0.45, floor 0.05)."""
    w = min((1 - step / steps) / cooldown_frac, 1.0)
    return w * 1.0 + (1 - w) * floor


def test_trapezoid_boundaries():
    cfg = TrainConfig(steps=100, warmup_steps=10, warmdown_steps=20, final_lr_frac=0.1)
    assert lr_multiplier(0, cfg) == pytest.approx(0.1)  # first warmup step
    assert lr_multiplier(9, cfg) == pytest.approx(1.0)  # warmup reaches the peak
    assert lr_multiplier(10, cfg) == 1.0
    assert lr_multiplier(79, cfg) == 1.0  # last constant step
    # the records' (N - s) / W: 1 on the first warmdown step, 1/W (above the floor) on the last
    assert lr_multiplier(80, cfg) == pytest.approx(1.0)
    assert lr_multiplier(81, cfg) == pytest.approx(0.1 + 0.9 * 19 / 20)
    assert lr_multiplier(99, cfg) == pytest.approx(0.1 + 0.9 / 20)
    values = [lr_multiplier(s, cfg) for s in range(80, 100)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))


def test_constant_without_warmup_or_warmdown():
    cfg = TrainConfig(steps=5, warmup_steps=0, warmdown_steps=0)
    assert [lr_multiplier(s, cfg) for s in range(5)] == [1.0] * 5


def llmc_cosine(step: int, steps: int, warmup: int, final_frac: float) -> float:
    """get_learning_rate of llm.c (karpathy/llm.c llmc/schedulers.h), as a multiplier of the peak:
    warmup (step + 1)/warmup, then decay_ratio = (step - warmup) / (train_num_batches - warmup)."""
    if step < warmup:
        return (step + 1) / warmup
    coeff = 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (steps - warmup)))
    return final_frac + coeff * (1 - final_frac)


def test_cosine_matches_formula():
    cfg = TrainConfig(steps=101, warmup_steps=1, schedule="cosine", final_lr_frac=0.0)
    assert lr_multiplier(0, cfg) == 1.0
    assert lr_multiplier(50, cfg) == pytest.approx(0.5 * (1 + math.cos(math.pi * 49 / 100)))
    assert 0 < lr_multiplier(100, cfg) < 1e-3  # llm.c never reaches the floor: r = 99/100 on the last step


def test_gpt2_baseline_follows_llmc_at_every_step():
    """The 2024-10-13 llm.c record: -l 0.0006 -u 700 -q 0.0, 19,560 steps (its main.log prints
    lr:0.000001, 0.000002, 0.000003 at s:0..2)."""
    cfg = load_recipe("gpt2-baseline")
    t = cfg.train
    want = [llmc_cosine(s, t.steps, t.warmup_steps, t.final_lr_frac) for s in range(t.steps)]
    got = [schedule_at(s, cfg).lr for s in range(t.steps)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert [round(6e-4 * g, 6) for g in got[:3]] == [0.000001, 0.000002, 0.000003]


def test_muon_momentum_warmup():
    cfg = OptimConfig(muon_momentum=0.95, muon_momentum_start=0.85, muon_momentum_warmup_steps=300)
    assert muon_momentum(0, cfg) == pytest.approx(0.85)
    assert muon_momentum(150, cfg) == pytest.approx(0.90)
    assert muon_momentum(300, cfg) == pytest.approx(0.95)
    assert muon_momentum(10_000, cfg) == pytest.approx(0.95)


# the llm.c cosine baseline has its own test (test_gpt2_baseline_follows_llmc_at_every_step)
TRAPEZOID_RECIPES = [
    n
    for n in recipe_names()
    if not n.startswith("demo")
    and load_recipe(n).train.schedule != "cosine"
    and "lr=" not in load_recipe(n).train.stages  # stage LR multipliers (#46 on): the recipe's own test
]


@pytest.mark.parametrize("name", TRAPEZOID_RECIPES)
def test_every_record_recipe_follows_its_record_formula_at_every_step(name):
    cfg = load_recipe(name)
    t = cfg.train
    plan = stage_plan(cfg)  # extension steps after the scheduled ones: the recipe's own test checks them
    n = plan.scheduled_steps if plan is not None else t.steps
    if t.warmdown_frac > 0:
        expected = [sub3min_lr(s, n, t.warmdown_frac, t.final_lr_frac) for s in range(n)]
    else:
        expected = [record_trapezoid(s, n, t.warmup_steps, t.warmdown_steps) for s in range(n)]
    got = [schedule_at(s, cfg).lr for s in range(n)]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_sub3min_record_schedule_is_exact():
    cfg = load_recipe("record-2025-01")
    assert cfg.train.warmdown_frac == 0.4 and cfg.train.final_lr_frac == 0.1
    # the old trapezoid approximation (557 integer steps) was off by up to 1.6e-3 from this
    for s in (0, 835, 836, 1000, 1392):
        assert lr_multiplier(s, cfg.train) == pytest.approx(sub3min_lr(s, 1393), abs=1e-14)


def test_validation_at_a_step_uses_that_steps_window():
    cfg = load_recipe("flex-2024-11")  # 11-24: window 64 * floor((64 + 1728 * s/N) / 64)
    n = cfg.train.steps
    assert schedule_at(0, cfg).window == 64  # step 0's validation runs with the step-0 window
    assert schedule_at(n, cfg).window == 1792  # the final validation with the full window
    assert schedule_at(n - 1, cfg).window == 64 * ((64 + 1728 * (n - 1) / n) // 64)
