"""The gpt2026 family against the pre-split GPT: the five 2025 recipes, shrunk, must give the same fp32
loss, every gradient and three optimizer steps bit for bit, and the same seeded initialization
(tests/data/family_refs.json, made by tests/data/make_family_refs.py on the commit it names). Each
reference holds its shrunk config as that commit's config.json held it, so loading it also exercises
the converter of old run folders (config_model.legacy_model_table)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speedrun.config_files import config_from_dict
from speedrun.model.families import build_model
from tests.data.make_family_refs import RECIPES, init_values, run

REFS = json.loads((Path(__file__).parent / "data" / "family_refs.json").read_text())


def shrunk(name: str):
    """The recipe's shrunk config from the reference, read as an old config.json: a gpt2026 model."""
    cfg = config_from_dict(REFS["recipes"][name]["config"], name)
    assert cfg.model.family == "gpt2026"
    return cfg


def build(cfg):
    model = build_model(cfg.model)
    assert model.family == "gpt2026"
    return model


def mismatches(ours: dict, ref: dict) -> list[str]:
    """Names whose values differ (with both, to see how far off), and names only one side has."""
    out = [f"{n}: ours {ours.get(n)}, ref {ref[n]}" for n in ref if ours.get(n) != ref[n]]
    return out + [f"{n}: not in the reference" for n in ours if n not in ref]


def test_the_references_name_the_pre_split_commit():
    assert REFS["commit"].startswith("5ece166")


@pytest.mark.parametrize("name", RECIPES)
def test_gpt2026_reproduces_the_pre_split_gpt_bit_for_bit(name):
    ref = REFS["recipes"][name]
    ours = run(shrunk(name), build)
    assert ours["loss"] == ref["loss"], (ours["loss"], ref["loss"])
    assert not mismatches(ours["grads"], ref["grads"]), mismatches(ours["grads"], ref["grads"])
    for step, (a, b) in enumerate(zip(ours["steps"], ref["steps"], strict=True)):
        assert a["loss"] == b["loss"], (step, a["loss"], b["loss"])
        assert not mismatches(a["params"], b["params"]), (step, mismatches(a["params"], b["params"]))


@pytest.mark.parametrize("name", RECIPES)
def test_gpt2026_init_equals_the_pre_split_gpts(name):
    """Same seed, every parameter bit for bit (and so in distribution): the family creates its parts in
    the old order, so the generator hands every parameter the same draws. Same names."""
    ours, ref = init_values(shrunk(name), build), REFS["recipes"][name]["init"]
    assert sorted(ours) == sorted(ref)
    assert not mismatches(ours, ref), mismatches(ours, ref)
