"""Shared code reads a model config's 2024-named facts through its family's `facts` hook, never through
stand-in attributes on the other family's class (issue 36)."""

from __future__ import annotations

import dataclasses

import pytest

from speedrun.config import ModelConfig
from speedrun.config.families import ModelFacts, model_facts
from speedrun.config.gpt2026 import Gpt2026Config
from speedrun.model.gpt2024.layout import value_embed_layout
from speedrun.recipes import load_recipe, recipe_names
from tests.recipe_matrix import replace


def test_the_gpt2026_config_carries_no_gpt2024_switch_it_does_not_own():
    own = {f.name for f in dataclasses.fields(Gpt2026Config)}
    switches_2024 = {f.name for f in dataclasses.fields(ModelConfig)}
    stand_ins = (set(dir(Gpt2026Config)) | set(vars(Gpt2026Config()))) & switches_2024 - own
    assert not stand_ins, f"read these through config.families.model_facts: {sorted(stand_ins)}"


def test_gpt2024_facts_are_its_fields():
    m = load_recipe("record-2025-01").model
    facts = model_facts(m)
    switches = {f.name for f in dataclasses.fields(ModelConfig)}
    for f in dataclasses.fields(ModelFacts):
        if f.name in switches:
            assert getattr(facts, f.name) == getattr(m, f.name), f.name
    none = dict(yarn=False, mtp=0, gates=(0, 0, 0, 0, False), fp8_mlp=False, era=0)  # gpt2026's parts
    assert {k: getattr(facts, k) for k in none} == none
    for name in recipe_names():  # the tables the model's own layout uses
        m = load_recipe(name).model
        if m.family == "gpt2024":
            tables = len({j for j in value_embed_layout(m) if j is not None})
            assert (model_facts(m).value_tables, model_facts(m).qk_head_dim) == (tables, m.n_embd // m.n_head)


@pytest.mark.parametrize("name", [r for r in recipe_names() if load_recipe(r).model.family == "gpt2026"])
def test_gpt2026_facts_follow_its_parts(name):
    """Each part field a fact names moves the fact (and nothing but its own); what the family fixes
    stays fixed whatever the parts say."""
    m = load_recipe(name).model
    moved = {
        "window": ("attn", "window", m.attn.window + 128),
        "window_unit": ("attn", "window_unit", m.attn.window_unit * 2),
        "yarn": ("attn", "yarn", not m.attn.yarn),
        "attn_scale": ("attn", "scale", m.attn.scale + 0.5),
        "embed_dtype": ("embed", "dtype", "bf16" if m.embed.dtype == "fp32" else "fp32"),
        "pad_embeddings": ("embed", "pad", not m.embed.pad),
        "logit_softcap": ("head", "softcap", m.head.softcap + 1.0),
        "fp8_head": ("head", "fp8", not m.head.fp8),
        "zero_init_head": ("head", "zero_init", not m.head.zero_init),
    }
    before = model_facts(m)
    for fact, (part, field, value) in moved.items():
        after = model_facts(replace(m, **{part: dataclasses.replace(getattr(m, part), **{field: value})}))
        changed = {
            f.name
            for f in dataclasses.fields(ModelFacts)
            if getattr(after, f.name) != getattr(before, f.name)
        }
        assert changed == {fact}, (fact, changed)
        assert getattr(after, fact) == value
    assert model_facts(replace(m, windows=["S"] * m.n_layer)).window_pattern == "S" * m.n_layer
    fixed = dict(tie_embeddings=False, fused_qkv=True, bf16_model=False, positional="rotary",
                 document_mask=True, rope_half_truncated=True, window_block_list=False)  # fmt: skip
    assert {k: getattr(before, k) for k in fixed} == fixed
