"""The recipe covers of the per-recipe graph tests (tests/recipe_cover.py): the chosen recipes use every
(setting, value) pair that any bundled recipe uses, each chosen recipe is needed, and a new value in
any recipe brings that recipe in."""

from __future__ import annotations

import dataclasses

import pytest

from speedrun.config import MODEL_FAMILIES, ModelConfig
from speedrun.recipes import recipe_names
from tests.recipe_cover import LAYOUT_FIELDS, cover, graph_settings, recipe_cover
from tests.recipe_matrix import compile_config
from tests.unit.test_kv_cache import decode_config

USES = {"compile": compile_config, "decode": decode_config}  # the tests that run a cover


@pytest.mark.parametrize("use", list(USES))
def test_the_cover_uses_every_setting_of_every_recipe_and_needs_each_recipe(use):
    settings = {name: graph_settings(USES[use](name)) for name in recipe_names()}
    chosen = recipe_cover(USES[use])
    every = set().union(*settings.values())
    assert every - set().union(*(settings[n] for n in chosen)) == set()
    assert len(chosen) < len(settings)  # the point of a cover
    for name in chosen:  # the check above fails when any one chosen recipe is left out
        missing = every - set().union(*(settings[n] for n in chosen if n != name))
        assert missing, f"{name} adds nothing to the {use} cover"


def test_a_new_value_in_any_recipe_brings_that_recipe_into_the_cover():
    """A recipe that only differs from the others by one value (one model field, or one combination
    of layout fields whose values other recipes each use) is picked."""
    today = recipe_cover(compile_config)
    for name, override in [("demo", "model.logit_softcap=7"), ("seed-2024-10", "model.document_mask=true")]:
        changed = lambda n, name=name, o=override: compile_config(n, o) if n == name else compile_config(n)
        assert name not in today and name in recipe_cover(changed), name


def test_every_model_field_is_a_setting():
    """A model field added later counts without a change here: each is a setting of its own or part of
    the joint layout value, and changing one changes the settings."""
    base = compile_config("demo")
    names = {name for name, _ in graph_settings(base)}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert {f"model.{f}" for f in fields - set(LAYOUT_FIELDS)} | {"model.layout"} <= names
    families = {f.name for cls in MODEL_FAMILIES.values() for f in dataclasses.fields(cls)}
    assert set(LAYOUT_FIELDS) <= families  # each family's layout fields
    for field in ("window_pattern", "value_embeds", "n_layer"):
        other = dataclasses.replace(base, model=dataclasses.replace(base.model, **{field: None}))
        assert graph_settings(other) != graph_settings(base), field


def test_cover_is_greedy_then_pruned_and_in_input_order():
    def pairs(*values: int) -> set:
        return {("s", str(v)) for v in values}

    # greedy takes x (most pairs), then y and z for 6 and 7; y and z hold all of x, so x is pruned
    settings = {"z": pairs(4, 5, 7), "x": pairs(1, 2, 3, 4, 5), "y": pairs(1, 2, 3, 6), "w": pairs(6)}
    assert cover(settings) == ["z", "y"]
    settings["w"].add(("t", "0"))
    assert cover(settings) == ["z", "x", "w"]
