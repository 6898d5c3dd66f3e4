"""Issue 36: the gpt2026 model config keeps shape, per-layer lists and rules between parts; each part
owns a frozen table (`[model.mudd]`, ...) with its own check. Flat keys of before the parts (old
config.json files, recipes, command lines) map to the tables at the edge. Torch-free."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from speedrun.config import all_keys
from speedrun.config.files import config_from_dict, flatten, read_run_config, set_value
from speedrun.config.gpt2026 import FLAT, PARTS, Gpt2026Config
from speedrun.errors import ConfigError
from speedrun.recipes import load_recipe
from tests.conftest import run_speedrun

#: record-2026-07's config.json as the code before the parts wrote it (to_dict at 4a38b5f): flat keys
FLAT_RECORD = Path(__file__).parents[1] / "data" / "record_2026_07_flat_config.json"


def test_the_model_config_has_at_most_26_top_level_fields_and_frozen_parts():
    fields = dataclasses.fields(Gpt2026Config)
    assert len(fields) <= 26, [f.name for f in fields]  # 25 + #92's [model.ngram]
    m = Gpt2026Config()
    for name in PARTS:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(getattr(m, name), dataclasses.fields(getattr(m, name))[0].name, 1)


def test_an_old_flat_config_json_loads_to_the_nested_recipe(tmp_path):
    old = json.loads(FLAT_RECORD.read_text())
    assert "mudd_sources" in old["model"] and "mudd" not in old["model"]  # really the flat form
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg, recipe = read_run_config(tmp_path), load_recipe("record-2026-07")
    assert cfg.to_dict() == recipe.to_dict()
    assert cfg.model.mudd.sources == [7, 3] and cfg.model.mlp.fp8 and cfg.model.embed.bigram_dim == 192
    # every flat key of the old file reads back, value for value, under its table's key
    new = flatten(cfg.to_dict())
    for key, value in old["model"].items():
        dotted = "model." + ".".join(FLAT[key]) if key in FLAT else f"model.{key}"
        assert new[dotted] == value, key


def nest(model: dict) -> dict:
    """A `model` table with flat part keys (an old config.json or recipe) as one with part tables."""
    out: dict = {}
    for key, value in model.items():
        if key in FLAT and not isinstance(value, dict):
            part, name = FLAT[key]
            out.setdefault(part, {})[name] = value
        else:
            out[key] = value
    return out


def test_every_old_flat_key_maps_to_a_distinct_part_field_and_nest_is_its_inverse():
    assert len(set(FLAT.values())) == len(FLAT)
    flat = {k: v for k, v in json.loads(FLAT_RECORD.read_text())["model"].items()}
    assert len([k for k in flat if k in FLAT]) == len(FLAT)  # the old file had every part field
    nested = nest(flat)
    flat_parts = {part for part, _ in FLAT.values()}  # parts that came after the flat keys have none
    assert flat_parts == set(PARTS) - {"ngram"} and set(nested) >= flat_parts and not set(nested) & set(FLAT)
    assert (
        config_from_dict({"model": nested}, "t").to_dict()["model"]
        == config_from_dict({"model": flat}, "t").to_dict()["model"]
    )


def test_a_flat_override_and_a_table_key_set_the_same_field():
    a = load_recipe("record-2026-07", ["model.mudd_sources=[6,2]", "model.logit_softcap=20"])
    b = load_recipe("record-2026-07", ["model.mudd.sources=[6,2]", "model.head.softcap=20"])
    assert a.to_dict() == b.to_dict() and a.model.mudd.sources == [6, 2] and a.model.head.softcap == 20
    assert {"model.mudd.sources", "model.head.softcap"} <= a.fixed  # the keys the user fixed, as spelled
    before = load_recipe("record-2026-07").model
    assert a.model.mudd is not before.mudd and a.model.attn == before.attn  # the part was replaced


def test_unknown_nested_keys_are_one_line_with_a_hint():
    cfg = load_recipe("record-2026-07")
    with pytest.raises(
        ConfigError, match=r"unknown config key 'model\.mudd\.source' \(did you mean model\.mudd\.sources\?\)"
    ):
        set_value(cfg, "model.mudd.source", [7, 3])
    with pytest.raises(ConfigError, match="unknown config key 'model.mudd'"):
        set_value(cfg, "model.mudd", {"sources": [7, 3]})  # a part is set by its fields
    assert "model.mudd.sources" in all_keys() and "model.mudd_sources" not in all_keys()


def test_cli_refuses_a_parts_bad_value_and_an_unknown_part_key_in_one_line():
    for override, message in (
        ("model.embed.smear=769", "model.embed.smear (769) must not exceed model.n_embd (768)"),
        ("model.smear=769", "model.embed.smear (769) must not exceed model.n_embd (768)"),  # flat
        ("model.head.sofcap=3", "unknown config key 'model.head.sofcap' (did you mean model.head.softcap?)"),
    ):
        proc = run_speedrun("train", "--recipe", "record-2026-07", "--dry-run", override)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_dry_run_prints_the_part_tables():
    proc = run_speedrun("train", "--recipe", "record-2026-07", "--dry-run", "model.mudd_sources=[6,2]")
    assert proc.returncode == 0, proc.stderr
    model = json.loads(proc.stdout[: proc.stdout.index("\nparams:")])["model"]
    assert model["mudd"]["sources"] == [6, 2] and "mudd_sources" not in model


def test_a_bf16_fallback_resets_a_parts_storage_field_unless_the_user_fixed_it():
    """train/precision.effective_config: `model.embed.dtype` lives in a part now; the fallback still
    reaches it (by its flat name, through the converter) and still leaves a fixed one alone."""
    from speedrun.train.plan.precision import Precision, effective_config

    fp32 = Precision("fp32", "this host runs bf16 slowly")
    cfg = load_recipe("demo-2026", ["train.dtype=bf16"])
    set_value(cfg, "model.embed_dtype", "bf16")  # as a bundled recipe sets it: not fixed
    assert effective_config(cfg, fp32).model.embed.dtype == "fp32" and cfg.model.embed.dtype == "bf16"
    fixed = load_recipe("demo-2026", ["train.dtype=bf16", "model.embed_dtype=bf16"])
    assert effective_config(fixed, fp32).model.embed.dtype == "bf16"


def test_a_part_key_on_a_gpt2024_model_names_its_family_flat_or_dotted():
    for key in ("model.mudd_sources", "model.mudd.sources"):
        with pytest.raises(ConfigError, match=f"^{key} is a gpt2026 key; this model is gpt2024"):
            load_recipe("demo", [f"{key}=[1,2]"])
