"""Recipes resolve to typed configs; overrides are type-checked; parameter counts match the records."""

import pytest
import torch

from speedrun.config import Config, parse_overrides
from speedrun.errors import ConfigError
from speedrun.model.gpt import GPT
from speedrun.recipes import load_recipe, recipe_names

FOUNDATION_RECIPES = ["demo", "demo-adamw", "gpt2-baseline", "muon-2024-10", "untied-2024-11"]


def n_params(cfg: Config) -> int:
    with torch.device("meta"):
        model = GPT(cfg.model)
    return sum(p.numel() for p in model.parameters())


def test_foundation_recipes_are_bundled_and_described():
    names = recipe_names()
    for name in FOUNDATION_RECIPES:
        assert name in names
        assert len(load_recipe(name).description) > 40


@pytest.mark.parametrize(
    "recipe, overrides, expected",
    [
        # llm.c GPT-2 124M: 124,439,808 with the 50,257 vocab; 124,475,904 padded to 50,304.
        ("gpt2-baseline", ["model.pad_vocab_to=1"], 124_439_808),
        ("gpt2-baseline", [], 124_475_904),
        # 2024-10-10: 12 x (2304*768 + 768*768 + 2*768*3072) + 50,257*768 (tied, unpadded).
        ("muon-2024-10", [], 12 * (2304 * 768 + 768 * 768 + 2 * 768 * 3072) + 50257 * 768),
        # the 2024-10-04 seed: the 10-10 model.
        ("seed-2024-10", [], 12 * (2304 * 768 + 768 * 768 + 2 * 768 * 3072) + 50257 * 768),
        # 2024-10-14 / 10-17: separate q, k, v (same count as fused), tied vocab padded to 50,304.
        ("modern-2024-10", [], 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 50304 * 768),
        ("distributed-muon-2024-10", [], 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 50304 * 768),
        # 2024-11-03: same blocks + untied embedding and head of 50,304 rows each.
        ("untied-2024-11", [], 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 2 * 50304 * 768),
        # 2024-11-06: 11-03 + one value-residual λ per layer + (λ0, λ1) shortcut per block = 162,201,636.
        ("shortcuts-2024-11", [], 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 2 * 50304 * 768 + 12 + 12 * 2),
        # 2024-11-10: + 6 U-Net skip weights = 162,201,642; 11-19/11-24 FlexAttention: the same model.
        ("unet-2024-11", [], 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 2 * 50304 * 768 + 12 + 24 + 6),
        ("flex-2024-11", [], 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 2 * 50304 * 768 + 12 + 24 + 6),
        ("flex-2024-11-19", [], 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 2 * 50304 * 768 + 12 + 24 + 6),
        # 2024-12-04: + value embedding (50,304, 768·12), the λ now mixes it instead of v1 = 625,803,306.
        (
            "value-embed-2024-12",
            [],
            12 * (4 * 768 * 768 + 2 * 768 * 3072) + 2 * 50304 * 768 + 12 + 24 + 6 + 50304 * 768 * 12,
        ),
        # 2024-12-08: 6 value tables of (50,304, 768) in U-Net order, (λ0, λ1) per layer = 394,002,486.
        (
            "unet-value-embed-2024-12",
            [],
            12 * (4 * 768 * 768 + 2 * 768 * 3072) + 2 * 50304 * 768 + 12 * 2 + 24 + 6 + 50304 * 768 * 6,
        ),
        # 2025-01-16 Sub3Min: 11 attention layers (block 7 has none), 12 MLPs, embedding and 3 value tables
        # of 50,257 rows, head of 50,304 rows, 11·2 + 12·2 λ and 6 skip weights = 275,598,388.
        (
            "record-2025-01",
            [],
            11 * 4 * 768 * 768 + 12 * 2 * 768 * 3072 + 4 * 50257 * 768 + 50304 * 768 + 11 * 2 + 12 * 2 + 6,
        ),
        # demo-2025-01: demo (4 x (4·256² + 2·256·1024) + 2 x 4096·256) + one 4096 x 256 value table
        # + 2 skip weights + 4 x 2 shortcut λ + 4 x 2 value λ = 6,291,474.
        ("demo-2025-01", [], 4 * (4 * 256 * 256 + 2 * 256 * 1024) + 3 * 4096 * 256 + 2 + 8 + 8),
    ],
)
def test_parameter_counts(recipe, overrides, expected):
    assert n_params(load_recipe(recipe, overrides)) == expected


def test_overrides_are_typed():
    cfg = load_recipe(
        "demo", ["model.n_layer=2", "optim.betas=0.8,0.99", "train.compile=off", "model.bias=true"]
    )
    assert cfg.model.n_layer == 2 and cfg.optim.betas == (0.8, 0.99) and cfg.model.bias is True
    assert cfg.train.compile == "off"


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.n_layers=2", "unknown config key 'model.n_layers' (did you mean model.n_layer?)"),
        ("model.n_layer=two", "model.n_layer: expected an integer"),
        ("model.bias=maybe", "model.bias: expected true or false"),
        ("optim.name=sgd", "optim.name: 'sgd' is not one of adamw, muon"),
        ("optim.betas=0.9", "optim.betas: expected 2 comma-separated values"),
        ("nosection=1", "unknown config key 'nosection'"),
        ("justakey", "not of the form key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match=None) as info:
        parse_overrides(Config(), [override])
    assert fragment in str(info.value)


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="multiple of train.seq_len"):
        load_recipe("demo", ["train.micro_batch_tokens=1000"])
    with pytest.raises(ConfigError, match="divisible by model.n_head"):
        load_recipe("demo", ["model.n_head=3"])


def test_bundled_name_wins_over_a_folder_of_that_name(tmp_path, monkeypatch):
    (tmp_path / "demo").mkdir()  # e.g. a run directory called demo
    monkeypatch.chdir(tmp_path)
    assert load_recipe("demo").recipe == "demo"


def test_unknown_recipe_lists_known_ones():
    with pytest.raises(ConfigError, match="unknown recipe 'nope'.*demo"):
        load_recipe("nope")


def test_user_recipe_file_inherits_from_bundled(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('base = "demo"\ndescription = "mine"\n[model]\nn_layer = 2\n')
    cfg = load_recipe(str(path))
    assert cfg.recipe == "mine" and cfg.model.n_layer == 2
    assert cfg.model.n_embd == load_recipe("demo").model.n_embd


def test_user_recipe_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nwidth = 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'model.width'"):
        load_recipe(str(bad))
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_recipe(str(broken))
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_recipe(str(tmp_path / "missing.toml"))
