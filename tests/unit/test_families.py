"""The gpt2026 family against the pre-split GPT: the five 2025 recipes, shrunk, must give the same fp32
loss, every gradient and three optimizer steps bit for bit, and the same seeded initialization
(tests/data/family_refs.json, made by tests/data/make_family_refs.py on the commit it names). Bit for
bit holds only on the kernels the references were made with (their `kernels`: tests/stored.py); the
references of 5ece166 were made on an Intel Xeon (AVX512-BF16, AMX) before fingerprints were recorded,
so every host compares within fp32 rounding: other kernels sum matmuls in another order (measured: under
AVX2 kernels loss equal, gradient norms within 2e-3 relative on tiny scalars and 1e-5 elsewhere,
parameters after 3 steps within 3e-5; on an AMD AVX-512 host gradient norms within 3e-5). Each
reference holds its shrunk config as that commit's config.json held it, so loading it also exercises
the converter of old run folders (config.gpt2026.legacy_model_table)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speedrun.config.files import config_from_dict
from speedrun.model.families import build_model
from tests.data.make_family_refs import RECIPES, init_values, run
from tests.stored import agree, same_kernels

REFS = json.loads((Path(__file__).parents[1] / "data" / "family_refs.json").read_text())
SAME_KERNELS = same_kernels(REFS.get("kernels"))


def shrunk(name: str):
    """The recipe's shrunk config from the reference, read as an old config.json: a gpt2026 model."""
    cfg = config_from_dict(REFS["recipes"][name]["config"], name)
    assert cfg.model.family == "gpt2026"
    return cfg


def build(cfg):
    model = build_model(cfg.model)
    assert model.family == "gpt2026"
    return model


def mismatches(ours: dict, ref: dict, rel: float = 0.0, exact: bool = False) -> list[str]:
    """Names whose values differ (with both, to see how far off), and names only one side has. Values
    are [sha256 of the bytes, fp64 norm]: equal on the references' kernels, else norms within `rel`."""

    def same(a: list | None, b: list) -> bool:
        if SAME_KERNELS or exact or a is None:
            return a == b
        return abs(a[1] - b[1]) <= rel * abs(b[1]) + 1e-12

    out = [f"{n}: ours {ours.get(n)}, ref {ref[n]}" for n in ref if not same(ours.get(n), ref[n])]
    return out + [f"{n}: not in the reference" for n in ours if n not in ref]


def close(a: float, b: float) -> bool:
    return agree(a, b, 1e-6, SAME_KERNELS)


def test_the_references_name_the_pre_split_commit():
    assert REFS["commit"].startswith("5ece166")


@pytest.mark.parametrize("name", RECIPES)
def test_gpt2026_reproduces_the_pre_split_gpt_bit_for_bit(name):
    ref = REFS["recipes"][name]
    ours = run(shrunk(name), build)
    assert close(ours["loss"], ref["loss"]), (ours["loss"], ref["loss"])
    bad = mismatches(ours["grads"], ref["grads"], rel=1e-2)
    assert not bad, bad
    for step, (a, b) in enumerate(zip(ours["steps"], ref["steps"], strict=True)):
        assert close(a["loss"], b["loss"]), (step, a["loss"], b["loss"])
        bad = mismatches(a["params"], b["params"], rel=1e-4)
        assert not bad, (step, bad)


@pytest.mark.parametrize("name", RECIPES)
def test_gpt2026_init_equals_the_pre_split_gpts(name):
    """Same seed, every parameter bit for bit (and so in distribution): the family creates its parts in
    the old order, so the generator hands every parameter the same draws. Same names."""
    ours, ref = init_values(shrunk(name), build), REFS["recipes"][name]["init"]
    assert sorted(ours) == sorted(ref)
    bad = mismatches(ours, ref, exact=True)  # draws from the generator: no kernel-dependent sums
    assert not bad, bad


def test_a_family_is_picked_first_and_a_new_family_inherits_no_model_table():
    """bos-align-2025-07 (gpt2026) is based on record-2025-01 (gpt2024): it inherits [optim], [data] and
    [train], but its [model] starts from the gpt2026 defaults; `model.family` given last on the command
    line still applies first, so the keys given before it are kept."""
    import dataclasses

    from speedrun.config.gpt2026 import Gpt2026Config
    from speedrun.recipes import load_recipe

    base, cfg = load_recipe("record-2025-01"), load_recipe("bos-align-2025-07")
    assert (base.model.family, cfg.model.family) == ("gpt2024", "gpt2026")
    assert cfg.optim.muon_momentum_warmup_steps == base.optim.muon_momentum_warmup_steps > 0  # inherited
    assert cfg.model.head.mtp == Gpt2026Config().head.mtp and cfg.model.n_layer == 12
    overrides = ["model.n_layer=2", "model.attention=sdpa", "model.family=gpt2026", "model.mlp_layers=[0,1]"]
    overrides += [
        "model.n_head=4",
        "model.n_embd=256",
        "model.vocab_size=4096",
        "model.max_seq_len=256",
        "model.eot_id=4095",
    ]  # the size a switch must be given (issue 46)
    demo = load_recipe("demo", overrides)
    assert demo.model.n_layer == 2 and isinstance(demo.model, Gpt2026Config)
    assert dataclasses.asdict(load_recipe("demo").model)["family"] == "gpt2024"
