"""LR and momentum schedules at their boundaries."""

import math

import pytest

from speedrun.config import OptimConfig, TrainConfig
from speedrun.train.schedule import lr_multiplier, muon_momentum


def test_trapezoid_boundaries():
    cfg = TrainConfig(steps=100, warmup_steps=10, warmdown_steps=20, final_lr_frac=0.1)
    assert lr_multiplier(0, cfg) == pytest.approx(0.1)  # first warmup step
    assert lr_multiplier(9, cfg) == pytest.approx(1.0)  # warmup reaches the peak
    assert lr_multiplier(10, cfg) == 1.0
    assert lr_multiplier(79, cfg) == 1.0  # last constant step
    assert lr_multiplier(80, cfg) == pytest.approx(1 - 0.9 / 20)  # first warmdown step
    assert lr_multiplier(99, cfg) == pytest.approx(0.1)  # the floor, exactly at the last step
    values = [lr_multiplier(s, cfg) for s in range(80, 100)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))


def test_constant_without_warmup_or_warmdown():
    cfg = TrainConfig(steps=5, warmup_steps=0, warmdown_steps=0)
    assert [lr_multiplier(s, cfg) for s in range(5)] == [1.0] * 5


def test_cosine_matches_formula():
    cfg = TrainConfig(steps=101, warmup_steps=1, schedule="cosine", final_lr_frac=0.0)
    assert lr_multiplier(0, cfg) == 1.0
    assert lr_multiplier(100, cfg) == pytest.approx(0.0, abs=1e-12)
    assert lr_multiplier(50, cfg) == pytest.approx(0.5 * (1 + math.cos(math.pi * 49 / 99)))


def test_muon_momentum_warmup():
    cfg = OptimConfig(muon_momentum=0.95, muon_momentum_start=0.85, muon_momentum_warmup_steps=300)
    assert muon_momentum(0, cfg) == pytest.approx(0.85)
    assert muon_momentum(150, cfg) == pytest.approx(0.90)
    assert muon_momentum(300, cfg) == pytest.approx(0.95)
    assert muon_momentum(10_000, cfg) == pytest.approx(0.95)
