"""Recipes resolve to typed configs; overrides are type-checked; parameter counts match the records."""

import pytest
import torch

from speedrun.config import Config
from speedrun.config.files import parse_overrides
from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe, recipe_names

FOUNDATION_RECIPES = ["demo", "demo-adamw", "gpt2-baseline", "muon-2024-10", "untied-2024-11"]


def n_params(cfg: Config) -> int:
    with torch.device("meta"):
        model = build_model(cfg.model)
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
        # track 3 (train_gpt_simple.py): biases in every linear (the head too), RMSNorm gains in the blocks,
        # after the embedding and before the head; untied embedding and head of 50,304 rows = 162,354,816.
        (
            "track3-baseline",
            [],
            12 * (4 * (768 * 768 + 768) + 2 * 768 * 3072 + 3072 + 768 + 2 * 768)
            + 2 * 50304 * 768
            + 50304
            + 2 * 768,
        ),
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
    documents = ["data.loader=documents"]  # one row per micro-batch (issue 20)
    with pytest.raises(ConfigError, match=r"train.seq_len \(256\) must equal train.micro_batch_tokens"):
        load_recipe("demo", documents)
    rows = [*documents, "train.micro_batch_tokens=256", "train.global_batch_tokens=8192"]
    load_recipe("demo", rows)
    with pytest.raises(ConfigError, match="data.max_docs must be 0"):
        load_recipe("demo", [*rows, "data.max_docs=1"])


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


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.n_head=0", "model.n_head must be >= 1, got 0"),
        ("model.n_layer=0", "model.n_layer must be >= 1"),
        ("model.n_layer=-2", "model.n_layer must be >= 1"),
        ("model.n_embd=0", "model.n_embd must be >= 1"),
        ("model.mlp_ratio=0", "model.mlp_ratio must be >= 1"),
        ("optim.lr=nan", "optim.lr must be a finite number, got nan"),
        ("optim.lr=-0.1", "optim.lr must be >= 0"),
        ("optim.muon_lr=nan", "optim.muon_lr must be a finite number"),
        ("optim.embed_lr=inf", "optim.embed_lr must be a finite number"),
        ("optim.betas=2,3", "optim.betas must be >= 0 and < 1, got 2.0"),
        ("optim.betas=0.9,1", "optim.betas must be >= 0 and < 1, got 1.0"),
        ("optim.eps=0", "optim.eps must be > 0"),
        ("optim.muon_momentum=1.5", "optim.muon_momentum must be >= 0 and < 1"),
        ("model.max_seq_len=2000000000", "model.max_seq_len=2000000000 and model.n_layer="),
        ("model.max_seq_len=4000000000", "model.max_seq_len must be >= 1 and <= 2,147,483,647"),
        ("model.n_embd=1048576", "GiB of fp32 weights, more than this machine's"),
        ("train.checkpoint_every=-1", "train.checkpoint_every must be >= 0"),
        ("train.checkpoint_keep=-1", "train.checkpoint_keep must be >= 0"),
        ("train.val_every=-5", "train.val_every must be >= 0"),
        ("train.warmup_steps=-1", "train.warmup_steps must be >= 0"),
        ("train.timing_warmup_steps=-1", "train.timing_warmup_steps must be >= 0"),
        ("train.log_every=0", "train.log_every must be >= 1"),
        ("train.steps=0", "train.steps must be >= 1"),
        ("train.warmup_steps=1000", "train.warmup_steps + the warm-down"),
        ("train.seq_len=4096", "train.seq_len (4096) exceeds model.max_seq_len"),
        ("train.final_lr_frac=2", "train.final_lr_frac must be >= 0 and <= 1"),
        ("train.seed=-1", "train.seed must be >= 0"),
        ("data.tokenizer=bpe:99999999", "data.tokenizer: tokenizer 'bpe:99999999': N must be between"),
        ("data.tokenizer=gpt3", "data.tokenizer: unknown tokenizer 'gpt3'"),
    ],
)
def test_impossible_numbers_are_refused_naming_the_key(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_recipe("demo", [override])
    assert fragment in str(info.value)


def _numeric_fields():
    import dataclasses
    import typing

    from speedrun import config
    from speedrun.config.types import strip_annotation

    for section, cls in config.sections().items():
        for f in dataclasses.fields(cls):
            typ, _ = strip_annotation(typing.get_type_hints(cls, include_extras=True)[f.name])
            if typ in (int, float):
                yield f"{section}.{f.name}", typ


@pytest.mark.parametrize("key, typ", list(_numeric_fields()))
def test_every_numeric_field_is_range_checked(key, typ):
    """The mechanism, not a list: every int/float field (a new one too) refuses -1, and floats refuse nan."""
    from speedrun.config.checks import validate

    for bad in (-1, float("nan")) if typ is float else (-1,):
        cfg = load_recipe("demo")
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, bad)  # as code that edits a Config would
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(cfg)


def _choices(key: str) -> tuple[str, ...] | None:
    """Allowed values of a string-choice key (from its Literal type), or None for free-form fields."""
    import typing

    from speedrun import config
    from speedrun.config.types import strip_annotation

    section, _, name = key.partition(".")
    classes = config.MODEL_FAMILIES.values() if section == "model" else [config.sections().get(section)]
    typ = next((config.key_type(c, name) for c in classes if c and config.key_type(c, name)), None)
    typ, _ = strip_annotation(typ)
    return typing.get_args(typ) if typing.get_origin(typ) is typing.Literal else None


def test_string_choices_come_from_the_literal_types():
    import dataclasses

    from speedrun import config

    assert not hasattr(config, "CHOICES")
    assert _choices("optim.name") == ("adamw", "muon", "normuon", "anvil")
    assert _choices("data.source") is None  # free-form
    for section, cls in config.sections().items():
        for f in dataclasses.fields(cls):
            allowed = _choices(f"{section}.{f.name}")
            if allowed:
                assert getattr(cls(), f.name) in allowed
                with pytest.raises(ConfigError, match="is not one of"):
                    parse_overrides(Config(), [f"{section}.{f.name}=not-a-choice"])


def test_unreadable_recipe_files_are_one_line(tmp_path):
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('description = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_recipe(str(latin1))
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    with pytest.raises(ConfigError, match="recipe file not found|is a directory"):
        load_recipe(str(folder))
    from speedrun.config.files import read_toml

    with pytest.raises(ConfigError, match="is a directory"):
        read_toml(folder)
    nan = tmp_path / "nan.toml"
    nan.write_text('base = "demo"\n[optim]\nmuon_lr = nan\n')  # nan is valid TOML
    with pytest.raises(ConfigError, match="optim.muon_lr must be a finite number"):
        load_recipe(str(nan))
