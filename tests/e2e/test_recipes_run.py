"""Each foundation recipe trains end to end when shrunk: the optimizers and model switches work together."""

import math

import pytest

from tests.e2e.runs import FOUNDATION_RECIPES


@pytest.mark.slow
@pytest.mark.parametrize("recipe", FOUNDATION_RECIPES)
def test_recipe_trains_a_few_steps(recipe, trained):
    """runs.py `foundation-RECIPE`: the recipe shrunk to TINY's sizes, six steps at its own learning rates."""
    records = trained(f"foundation-{recipe}").metrics
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2 and all(math.isfinite(v) for v in val)
    assert val[1] < val[0] - 0.02, val  # six steps at the recipe's own learning rates already help
