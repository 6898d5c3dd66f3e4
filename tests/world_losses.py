"""One command trained on 1 and on several processes: its metrics as (step, kind, loss) records and the
bound the two runs meet (e2e/test_normuon_worlds.py, unit/test_ngram_training.py,
e2e/test_anvil_recipe_worlds.py).

Bound: fp32, but a step's gradient is the mean of its micro-batch gradients summed in a different
association on each world size (((g1+g2)+g3)+g4 on one process, (g1+g2)+(g3+g4) on two, gloo's order on
four), and bf16 parts (Polar Express, the table's pushed rows) can move a rounding on such a last-bit
difference, which the run amplifies. Measured (2026-11-23, NorMuon), relative, first two training losses /
all records: 1 vs 2 processes 4e-7 / 4.1e-4; 1 vs 4: 2.9e-7 / 4.6e-4; resumed on 4 from the 2-process
step-3 checkpoint vs the 2-process run: 8e-8 / 1.3e-4. So the first two losses must agree to 1e-6 (a
bypassed or wrong reduction changes the first update by far more) and every later one to 1e-3."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics

EARLY, REL = 1e-6, 1e-3


def losses(run: Path) -> list[tuple[int, str, float]]:
    return [
        (r["step"], "val" if "val_loss" in r else "train", r.get("val_loss", r.get("train_loss")))
        for r in read_metrics(run)
    ]


def assert_same(a: list, b: list, first: int = 1) -> None:
    """Same records; losses of steps first and first + 1 within EARLY, the rest within REL."""
    assert [x[:2] for x in a] == [x[:2] for x in b]
    for x, y in zip(a, b, strict=True):
        rel = EARLY if x[0] in (first, first + 1) and x[1] == "train" else REL
        assert y[2] == pytest.approx(x[2], rel=rel, abs=0), (x, y)
