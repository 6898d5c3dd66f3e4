"""Parameters declare what they are (docs/design.md 14): the optimizer refuses a parameter without a
label in one line naming it; renaming a parameter's attribute leaves its training bit for bit as it
was (the old name rules gave a renamed MLP projection, gate or x0 lambda another LR, rule or group);
every label a bundled recipe's model declares has a row."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from speedrun.config.labels import label_table
from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.model.labels import LABELS, label_of, labelled
from speedrun.model.layers import MLP
from speedrun.optim.build import build_optimizer, model_rules
from speedrun.optim.rules import LabelError, param_rules
from speedrun.recipes import load_recipe
from speedrun.train.plan.memory import _optimizer_bytes
from tests.conftest import TINY, run_speedrun

RECIPES = sorted(p.stem for p in (Path(__file__).parents[2] / "src/speedrun/recipes").glob("*.toml"))
#: one recipe per optimizer: AdamW, Muon + Adam, the NorMuon table (gates, smear, x0 lambdas, lr muls)
PER_OPTIMIZER = ["gpt2-baseline", "record-2025-01", "stages-2025-12"]


def tiny(recipe: str, overrides: tuple[str, ...] = ()):
    cfg = load_recipe(recipe, list(overrides))
    m = dataclasses.replace(cfg.model, n_embd=64, n_head=2, vocab_size=128, max_seq_len=256)
    train = dataclasses.replace(cfg.train, dtype="fp32" if cfg.train.dtype == "auto" else cfg.train.dtype)
    return dataclasses.replace(cfg, model=m, train=train)


@pytest.mark.parametrize("recipe", PER_OPTIMIZER)
def test_an_unlabelled_matrix_is_refused_in_one_line_naming_it(recipe):
    cfg = tiny(recipe)
    model = build_model(cfg.model)
    model.blocks[1].mlp.extra = nn.Parameter(torch.zeros(8, 64))  # a part that forgot to label it
    with pytest.raises(LabelError) as err:
        build_optimizer(model, cfg)
    message = str(err.value)
    assert "blocks.1.mlp.extra" in message and "\n" not in message
    assert isinstance(err.value, ValueError) and isinstance(err.value, ConfigError)
    assert err.value.exit_code == 2
    with pytest.raises(LabelError, match="blocks.1.mlp.extra"):  # the memory estimate reads the same rows
        _optimizer_bytes(cfg, model, 1)


def test_a_label_without_a_row_is_refused_naming_the_parameter():
    cfg = tiny("stages-2025-12")
    model = build_model(cfg.model)
    rules = label_table(cfg.optim, 32)
    del rules["smear_gate"]
    with pytest.raises(LabelError, match=r"smear\.gate\.weight has label 'smear_gate'"):
        param_rules(model, rules)


def _rename(module: nn.Module, old: str, new: str) -> None:
    """Store the same submodule or parameter under another attribute name."""
    value = getattr(module, old)
    delattr(module, old)
    setattr(module, new, value)


def _steps(model: nn.Module, cfg, params_by_name: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Three optimizer steps with the same gradients per original name; the weights after them."""
    opt = build_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params_by_name.values():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    return {name: p.detach().clone() for name, p in params_by_name.items()}


@pytest.mark.parametrize("recipe", PER_OPTIMIZER)
def test_renaming_a_parameter_attribute_leaves_its_training_bit_for_bit(recipe):
    cfg = tiny(recipe)
    runs = []
    for rename in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg.model)
        by_name = dict(model.named_parameters())
        if rename:  # every attribute a name rule used to read: QKV, MLP projections, gates, x0 lambdas
            for block in model.blocks:
                if block.attn is not None:
                    _rename(block.attn, "c_attn", "fused_projection")
                    _rename(block.attn, "c_proj", "out")
                    if getattr(block.attn, "gate", None) is not None:  # the families differ in parts
                        _rename(block.attn.gate, "proj", "w")
                if block.mlp is not None:
                    _rename(block.mlp, "c_fc", "up")
                    _rename(block.mlp, "c_proj", "down")
                if getattr(block, "x0_lambda", None) is not None:
                    _rename(block, "x0_lambda", "shortcut_weight")
            if getattr(model, "smear", None) is not None:
                _rename(model.smear, "gate", "mixer")
            names = {n for n, _ in model.named_parameters()}
            assert names.isdisjoint({n for n in by_name if ".c_" in n or "x0_lambda" in n or "gate" in n})
        runs.append(_steps(model, cfg, by_name))
    plain, renamed = runs
    assert plain.keys() == renamed.keys()
    for name in plain:
        assert torch.equal(plain[name], renamed[name]), name


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_label_of_a_bundled_recipe_has_a_row(recipe):
    cfg = load_recipe(recipe)
    with torch.device("meta"):  # full size, no memory
        model = build_model(cfg.model)
    entries = model_rules(model, cfg)
    assert len(entries) == len(list(model.parameters()))
    assert {e.label.name for e in entries} <= set(LABELS)
    assert set(label_table(cfg.optim, 64)) == set(LABELS)  # every label a part may declare, not only these


def test_a_tied_weight_is_one_embedding():
    cfg = tiny("gpt2-baseline")
    model = build_model(cfg.model)
    assert model.wte.weight is model.lm_head.weight and label_of(model.wte.weight).name == "embed"
    assert [n for n, _, lab in labelled(model) if lab.name == "embed"] == ["wte.weight", "wpe.weight"]


def test_the_cli_refuses_an_unlabelled_parameter_in_one_line(text_data, tmp_path, monkeypatch):
    """`speedrun train` on a model part that forgot a label: exit 2, one line naming the parameter."""
    original = MLP.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.extra = nn.Parameter(torch.zeros(4, 4))

    monkeypatch.setattr(MLP, "__init__", init)
    result = run_speedrun("train", "--out", str(tmp_path / "run"), f"data.dir={text_data}", *TINY)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "blocks.0.mlp.extra" in lines[0], result.stderr
