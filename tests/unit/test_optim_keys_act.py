"""Issue 35, "every setting acts or is refused", the optimizer keys: a brute-force walk over every
OptimConfig key under optim.name=adamw. Each key given at a non-default valid value either changes what
the built optimizer does to the parameters (two steps on fixed gradients, against the default's) or is
refused with one line naming it. The walk failed on the code before the fix (muon_lr, embed_lr, ... acted
not and were accepted)."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from speedrun.config import OptimConfig
from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.optim.build import build_optimizer
from speedrun.recipes import load_recipe
from tests.conftest import TINY, TINY_ADAMW

# acts outside the optimizer: the loop clips the gradients before the step (train/loop.py)
IN_THE_LOOP = {"grad_clip"}
# the Tail-EMA's keys act only with it on: walked from a window inside two steps (tau 2, steps 1 and 2),
# each at a valid value of its own
TAIL = {"tail_ema_tau": 2, "tail_ema_start": 1, "tail_ema_end": 3}
TAIL_GIVEN = {"tail_ema_tau": 4, "tail_ema_start": 2, "tail_ema_end": 2}


def other(value: object, hint: object) -> object:
    """A valid value unlike ``value``: the other bool, another Literal choice, int + 1, a float moved
    inside (0, 1) when it is one, each tuple element moved."""
    hint = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):
        return next(c for c in typing.get_args(hint) if c != value)
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 0.5 + 0.01 if 0 <= value < 1 else value * 2
    if isinstance(value, tuple):
        return tuple(other(v, float) for v in value)
    raise AssertionError(f"no other value for {value!r}")


def cli(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ",".join(repr(v) for v in value) + "]"
    return str(value)


def stepped(overrides: list[str]) -> list[torch.Tensor]:
    """The parameters after two optimizer steps on fixed gradients (and the Tail-EMA's readout)."""
    cfg = load_recipe("demo-adamw", [*TINY_ADAMW, *overrides])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    with opt.readout():  # the weights validation sees (the Tail-EMA's blend where one is on)
        return [p.detach().clone() for p in model.parameters()]


HINTS = typing.get_type_hints(OptimConfig, include_extras=True)
# a part table (optim.ships) acts at the run's end, not in two steps: fidelity/test_terminal_ships.py walks it
KEYS = [
    f.name
    for f in dataclasses.fields(OptimConfig)
    if f.name not in ("name", "labels") and not dataclasses.is_dataclass(HINTS[f.name])
]


@pytest.mark.parametrize("key", KEYS)
def test_each_optim_key_acts_or_is_refused_under_adamw(key):
    default = getattr(OptimConfig(), key)
    value = TAIL_GIVEN.get(key, other(default, HINTS[key]))
    given = f"optim.{key}={cli(value)}"
    base = [f"optim.{k}={v}" for k, v in TAIL.items()] if key.startswith("tail_ema") else []  # given wins
    try:
        load_recipe("demo-adamw", [*TINY_ADAMW, *base, given])
    except ConfigError as e:
        assert f"optim.{key}" in str(e) and "\n" not in str(e), str(e)
        return
    if key in IN_THE_LOOP:
        return
    before, after = stepped(base), stepped([*base, given])
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)), f"{given} did nothing"


def test_the_tiny_overrides_of_muon_recipes_are_refused_under_adamw():
    with pytest.raises(ConfigError, match="optim.embed_lr has no effect under optim.name=adamw"):
        load_recipe("gpt2-baseline", TINY)
    load_recipe("demo", [*TINY_ADAMW, "optim.name=adamw"])  # the recipe's own Muon keys stay quiet
    with pytest.raises(ConfigError, match="optim.muon_lr has no effect under optim.name=adamw"):
        load_recipe("demo", ["optim.name=adamw", "optim.muon_lr=0.01"])


def test_betas_under_normuon_are_refused_and_act_under_muon():
    with pytest.raises(ConfigError, match="optim.betas has no effect under optim.name=normuon"):
        load_recipe("demo-normuon", ["optim.betas=[0.8,0.9]"])
    assert load_recipe("demo", ["optim.betas=[0.8,0.9]"]).optim.betas == (0.8, 0.9)
