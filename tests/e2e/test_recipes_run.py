"""Each foundation recipe trains end to end when shrunk: the optimizers and model switches work together."""

import json
import math

import pytest

from speedrun.recipes import load_recipe
from speedrun.train.loop import train
from tests.conftest import tiny_for

FOUNDATION = ["demo", "demo-adamw", "gpt2-baseline", "muon-2024-10", "untied-2024-11"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", FOUNDATION)
def test_recipe_trains_a_few_steps(recipe, text_data, tmp_path):
    overrides = [
        *tiny_for(recipe),
        f"data.dir={text_data}",
        "data.source=text:unused",
        "train.steps=6",
        "train.warmup_steps=0",
        "train.warmdown_steps=2",
        "train.val_every=6",
        "train.compile=off",
        "train.device=cpu",
    ]
    train(load_recipe(recipe, overrides), tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2 and all(math.isfinite(v) for v in val)
    assert val[1] < val[0] - 0.02, val  # six steps at the recipe's own learning rates already help
