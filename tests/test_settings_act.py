"""Issue 35, "every setting acts or is refused": each test failed on the code before its fix."""

from __future__ import annotations

import pytest

from speedrun.cli import main
from speedrun.config_labels import derived_rows
from speedrun.recipes import load_recipe

LABELLED = ("demo-2026", "banks-2026-01", "xsa-2026-04")


def refused(capsys, argv: list[str], *words: str) -> str:
    """`speedrun ARGV` ends with one `speedrun: error:` line naming WORDS, exit 2, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("speedrun: error:") and "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


@pytest.mark.parametrize("recipe", LABELLED)
@pytest.mark.parametrize("key", ["embed_lr", "scalar_lr", "adam_weight_decay", "eps", "head_lr"])
def test_a_flat_key_a_stated_row_shadows_is_refused(recipe, key, capsys):
    """The flat key feeds a derived row that a stated row replaces (the reference: derived_rows with the
    key changed), so it is refused even where it also feeds rows this model has no parameters for."""
    cfg = load_recipe(recipe)
    head_dim = cfg.model.n_embd // cfg.model.n_head
    before = derived_rows(cfg.optim, head_dim)
    setattr(cfg.optim, key, getattr(cfg.optim, key) * 2 + 0.001)
    shadowed = [lab for lab, row in derived_rows(cfg.optim, head_dim).items() if row != before[lab]]
    assert set(shadowed) & set(cfg.optim.labels), shadowed  # the key feeds a stated row
    refused(capsys, ["train", "--dry-run", "--recipe", recipe, f"optim.{key}=0.0123"], f"optim.{key}")


def test_a_flat_key_that_acts_is_kept():
    cfg = load_recipe("banks-2026-01", ["optim.muon_lr=0.01"])
    assert cfg.optim.muon_lr == 0.01
    cfg = load_recipe("xsa-2026-04", ["optim.x0_betas=[0.6,0.9]"])  # x0's row is taken back (x0 = {})
    assert cfg.optim.x0_betas == (0.6, 0.9)


@pytest.mark.parametrize(
    ("recipe", "family"), [("demo-2026", "gpt2024"), ("demo", "gpt2026"), ("xsa-2026-04", "gpt2024")]
)
def test_a_family_switch_without_its_model_is_refused(recipe, family, capsys):
    refused(capsys, ["train", "--dry-run", "--recipe", recipe, f"model.family={family}"], "model.family")


def test_a_family_switch_with_its_model_and_a_recipe_file_of_family_alone(tmp_path, capsys):
    cfg = load_recipe(
        "demo", ["model.family=gpt2026", "model.n_layer=2", "model.mlp_layers=[0,1]", "model.attention=sdpa"]
    )
    assert (cfg.model.family, cfg.model.n_layer) == ("gpt2026", 2)
    assert load_recipe("demo-2026", ["model.family=gpt2026"]).model == load_recipe("demo-2026").model
    alone = tmp_path / "alone.toml"
    alone.write_text('base = "demo-2026"\n[model]\nfamily = "gpt2024"\n')
    refused(capsys, ["train", "--dry-run", "--recipe", str(alone)], "model.family=gpt2024", "alone.toml")


@pytest.mark.parametrize("steps", [0, 7])
def test_a_warm_down_in_steps_the_user_gives_is_kept_zero_included(steps):
    """demo's recipe states warmdown_frac = 0.3: a user's train.warmdown_steps replaces it, 0 too."""
    assert load_recipe("demo").train.warmdown_frac > 0
    t = load_recipe("demo", [f"train.warmdown_steps={steps}"]).train
    assert (t.warmdown_frac, t.warmdown_steps, t.warmdown_span(100)) == (0.0, steps, steps)
