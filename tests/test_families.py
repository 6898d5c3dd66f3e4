"""The gpt2026 family against the pre-split GPT: the five 2025 recipes, shrunk, must give the same fp32
loss, every gradient and three optimizer steps bit for bit (tests/data/family_refs.json, made by
tests/data/make_family_refs.py on the commit it names), and the same initialization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speedrun.config_model import from_model_config
from speedrun.model.families import build_model
from tests.data.make_family_refs import RECIPES, overrides, run

REFS = json.loads((Path(__file__).parent / "data" / "family_refs.json").read_text())


def gpt2026(cfg):
    model = build_model(from_model_config(cfg.model))
    assert model.family == "gpt2026"
    return model


def mismatches(ours: dict, ref: dict) -> list[str]:
    """Names whose [sha, norm] differ, with both norms (how far off), and names only one side has."""
    out = [
        f"{n}: ours {ours.get(n, [0, None])[1]}, ref {ref.get(n, [0, None])[1]}"
        for n in ref
        if ours.get(n) != ref[n]
    ]
    return out + [f"{n}: not in the reference" for n in ours if n not in ref]


@pytest.mark.parametrize("name", RECIPES)
def test_gpt2026_reproduces_the_pre_split_gpt_bit_for_bit(name):
    ref = REFS["recipes"][name]
    assert ref["overrides"] == overrides(name), "the reference was made with other overrides"
    ours = run(name, gpt2026)
    assert ours["loss"] == ref["loss"], (ours["loss"], ref["loss"])
    assert not mismatches(ours["grads"], ref["grads"]), mismatches(ours["grads"], ref["grads"])
    for step, (a, b) in enumerate(zip(ours["steps"], ref["steps"], strict=True)):
        assert a["loss"] == b["loss"], (step, a["loss"], b["loss"])
        assert not mismatches(a["params"], b["params"]), (step, mismatches(a["params"], b["params"]))


@pytest.mark.parametrize("name", RECIPES)
def test_gpt2026_init_equals_the_pre_split_gpts(name):
    """Same seed, same parameters bit for bit: the family creates its parts in the old order, so the
    generator hands every parameter the same draws (a fortiori the same distribution)."""
    from speedrun.model.gpt import GPT
    from speedrun.recipes import load_recipe

    cfg = load_recipe(name, overrides(name))
    torch.manual_seed(0)
    old = dict(GPT(cfg.model).named_parameters())
    torch.manual_seed(0)
    new = dict(gpt2026(cfg).named_parameters())
    assert list(new) == list(old)
    for n, p in old.items():
        assert torch.equal(new[n], p), n
