"""Rules that depend on who set a key: the user (command line, own TOML files) or a bundled recipe.
A one-switch change must work (ablate, race), and a key the user gives must either act or be refused."""

import pytest

from speedrun.config import canonical_key
from speedrun.config.files import flatten
from speedrun.errors import ConfigError
from speedrun.recipes import load_recipe
from speedrun.train.schedule import lr_multiplier


def test_a_users_warmdown_in_steps_replaces_a_recipes_share():
    cfg = load_recipe("record-2025-01", ["train.warmdown_steps=100"])  # the recipe's warmdown_frac = 0.4
    assert cfg.train.warmdown_frac == 0 and cfg.train.warmdown_steps == 100
    n = cfg.train.steps
    assert lr_multiplier(n - 100, cfg.train) == 1.0 and lr_multiplier(n - 99, cfg.train) < 1.0
    shared = load_recipe("demo", ["train.warmdown_frac=0.25"])  # and a share replaces steps
    assert shared.train.warmdown_steps == 0 and shared.train.warmdown_frac == 0.25


def test_both_warmdowns_given_or_steps_with_stages_are_refused():
    with pytest.raises(ConfigError, match="not both"):
        load_recipe("demo", ["train.warmdown_steps=10", "train.warmdown_frac=0.2"])
    with pytest.raises(ConfigError, match="train.warmdown_steps .*must be 0"):  # stages own the cool-down
        load_recipe("stages-2025-12", ["train.warmdown_steps=100"])


def test_the_warmup_check_counts_the_warmdown_the_schedule_uses():
    """record-2025-01's warm-down is 40 % of the steps; its unused warmdown_steps must not refuse a short
    run."""
    cfg = load_recipe("record-2025-01", ["train.steps=20"])
    assert cfg.train.steps == 20
    with pytest.raises(ConfigError, match="warm-down"):
        load_recipe("record-2025-01", ["train.steps=20", "train.warmup_steps=15"])  # 15 + 8 > 20


@pytest.mark.parametrize(
    "switch, lr",
    [("model.embed.smear=0", "optim.smear_gate_lr=0.1"), ("model.skip_gate=0", "optim.skip_gate_lr=0.1")],
)
def test_switching_a_part_off_keeps_quiet_about_the_recipes_lr_but_not_the_users(switch, lr):
    cfg = load_recipe("banks-2026-01", [switch])  # the recipe's LR for the part: nothing left to train
    assert flatten(cfg.to_dict())[canonical_key(cfg.model, switch.split("=")[0])] == 0  # a flat key too
    with pytest.raises(ConfigError, match=lr.split("=")[0]):
        load_recipe("banks-2026-01", [switch, lr])
