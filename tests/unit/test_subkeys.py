"""Issue 35's remainder, "every setting acts or is refused": a sub-key given while the switch it belongs
to is off (config/subkeys.py NEEDS, checked by config.checks.check_subkeys). Every row of the table is
walked; a brute-force walk over the optimizer keys finds the keys that change nothing, which must be in
the table or named below with where they act. Before the table (5b3362e) 42 of the 67 rows were
accepted with rc 0 and read by nothing; the rest were refused by the scattered rules the table replaced."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from speedrun.cli import main
from speedrun.config import OptimConfig, field_types, sections
from speedrun.config.checks import ADAMW_READS, _alt_on
from speedrun.config.gpt2026 import Gpt2026Config
from speedrun.config.subkeys import NEEDS
from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.optim import build as optim_build
from speedrun.optim.build import build_optimizer
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_schedule, schedule_at
from tests.conftest import TINY
from tests.unit.test_optim_keys_act import cli

# where a row's switch is looked for off: the gpt2024 recipes, Muon and NorMuon first (under adamw a
# user's Muon key meets the adamw rule first)
RECIPES = [
    "demo",
    "demo-normuon",
    "demo-adamw",
    "gpt2-baseline",
    "flex-2024-11",
    "track3-2026-06",
    "bos-align-2025-07",
    "demo-2026",
]
SECTIONS = {cls: name for name, cls in sections().items()} | {Gpt2026Config: "model"}  # its rows: part.field
ROWS = [(SECTIONS[cls], name) for cls, rows in NEEDS.items() for name in rows]


def other(value: object, hint: object) -> object:
    """A valid value unlike `value`: the other bool, another choice, int + 2, a float moved inside [0, 1)
    when it is one (never onto itself), each tuple element moved."""
    hint = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):
        choices = typing.get_args(hint)
        return next(c for c in choices if c != value) if choices else "L"
    if isinstance(value, int):
        return value + 2
    if isinstance(value, float):
        return round(value * 0.5 + 0.013, 6) if 0 <= value < 1 else value * 2
    if isinstance(value, tuple):
        return tuple(other(v, float) for v in value)
    raise AssertionError(f"no other value for {value!r}")


# rows whose switch every bundled recipe turns on (or another rule names first): settings beside the sub-key
OFF = {
    "muon_ns_steps": ["optim.muon_backend=svd"],
    "muon_momentum_start": ["optim.muon_momentum_warmup_steps=0", "optim.muon_momentum_cooldown_steps=0"],
    "window_warmup": ["train.time_budget_s=0"],  # else the budget's own rule names it first (demo)
    "head.softcap_divisor": ["model.head.softcap=0"],
    "stream.skip_gate_form": ["model.skips=[]"],
    "head.softcap_in_bf16": ["model.head.softcap=0"],
}


def _default(cls: type, name: str) -> tuple[object, object]:
    """A row's field default and declared type; a gpt2026 row names its part's field (`attn.window_unit`)."""
    part, _, name = name.rpartition(".")
    cls = field_types(cls)[part] if part else cls
    return getattr(cls(), name), field_types(cls)[name]


def _base(section: str, name: str) -> tuple[str, str]:
    """A bundled recipe where one of the row's switches is off, and that switch's key (its sub-key is then at
    its default, or the recipe would not load)."""
    for recipe in RECIPES:
        obj = getattr(load_recipe(recipe), section)
        if type(obj) not in NEEDS or name not in NEEDS[type(obj)]:
            continue  # another family's model
        cfg = load_recipe(recipe, OFF.get(name, []))
        if cfg.optim.name == "adamw" and section == "optim" and name not in ADAMW_READS:
            continue
        off = [s for s in NEEDS[type(obj)][name] if not any(_alt_on(cfg, a) for a in s.split(" or "))]
        if off:
            return recipe, off[0].split(" or ")[0].removeprefix("!").partition("=")[0]
    raise AssertionError(f"no recipe in {RECIPES} leaves {section}.{name}'s switch off")


@pytest.mark.parametrize(("section", "name"), ROWS, ids=[f"{s}.{n}" for s, n in ROWS])
def test_every_subkey_alone_is_refused_in_one_line(section, name, capsys):
    recipe, switch = _base(section, name)
    cls = type(getattr(load_recipe(recipe), section))
    default, hint = _default(cls, name)
    value = other(default, hint)
    assert value != default
    if name == "window_pattern":  # one L per layer: a pattern the model would take with a window
        value = "L" * load_recipe(recipe).model.n_layer
    given = f"{section}.{name}={cli(value)}"
    assert main(["train", "--dry-run", "--recipe", recipe, *OFF.get(name, []), given]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"speedrun: error: {section}.{name}=") and "has no effect while" in err, err
    assert f"set {switch} " in err and err.endswith(f"drop {section}.{name}"), err


def test_a_default_stated_again_and_a_switch_the_user_turns_off_are_accepted():
    load_recipe("demo", ["optim.tail_ema_start=0", "optim.muon_soap_beta2=0.9", "model.window_unit=64"])
    # one switch takes a part out (ablate): the recipe's own sub-keys stay quiet ...
    cfg = load_recipe("track3-2026-06", ["optim.tail_ema_tau=0", "optim.ema_nesterov_step=0"])
    assert cfg.optim.tail_ema_start == 2400
    # ... and the same sub-key given beside it is refused
    with pytest.raises(ConfigError, match="optim.tail_ema_start=5 has no effect while optim.tail_ema_tau=0"):
        load_recipe("track3-2026-06", ["optim.tail_ema_tau=0", "optim.tail_ema_start=5"])


def test_a_users_recipe_file_is_the_user_giving_its_keys(tmp_path):
    own = tmp_path / "own.toml"
    own.write_text('base = "demo"\n[optim]\nema_nesterov_beta = 0.9\n')
    with pytest.raises(ConfigError, match="optim.ema_nesterov_beta=0.9 has no effect while optim.ema_nest"):
        load_recipe(str(own))
    own.write_text('base = "track3-2026-06"\n[optim]\ntail_ema_tau = 0\n')
    assert load_recipe(str(own)).optim.tail_ema_tau == 0


# Keys a brute-force walk finds acting on nothing in 3 steps of a tiny model although accepted, and why
# they are no rows of NEEDS: they act later in the run, outside the optimizer, only on a part this model
# lacks (the labels decide, optim/rules.py), or only on some hardware.
#
# Which keys change nothing depends on the host: `optim.muon_ns_dtype=auto` iterates Muon in bf16 where
# the CPU runs bf16 fast (AVX512-BF16, AMX: hardware.fast_bf16) and in fp32 elsewhere (AVX2). The walk
# runs once as each kind of host (fast_bf16 forced both ways), so every host checks both expectations:
# INERT holds on every host, INERT_WHERE[host] only there. (train.dtype plays no part: no forward runs,
# the gradients are drawn, and TINY fixes train.dtype=fp32.)
INERT = {
    "demo": {
        "grad_clip": "the loop clips the gradients before the step (train/loop.py)",
        "muon_momentum_cooldown_steps": "acts over the last N steps of the run",
        "muon_scale_in_bf16": "with fp32 iterations nothing is rounded; in bf16 the tiny model's shape "
        "scales (1, and 2 for its 256x64 MLP) are powers of two, exact in bf16: acts at other shapes",
        "muon_uw_floor": "a floor below ‖U‖/‖W‖ lifts nothing: acts at larger values",
        "muon_split_qkv": "acts on a fused QKV only; demo's is separate (model.fused_qkv=false)",
        "scalar_lr": "demo has no scalar parameters (parameter-free RMSNorm, no biases)",
        "scalar_bias_correction": "the same: no scalar parameters",
    },
    "demo-normuon": {
        "muon_momentum_cooldown_steps": "acts over the last N steps of the run",
        "muon_split_qkv": "acts on a fused QKV only (model.fused_qkv=false)",
        "embed_lr": "the embedding is tied to the head until optim.tie_until (94)",
        "tie_until": "moves the untie from step 94 to 96",
        "muon_qk_block_heads": "blocks of 2 heads are the whole Q of the tiny model's 2 heads",
        "scalar_freeze_steps": "pauses at window or stage transitions; this model has none",
        "scalar_lr": "no scalar parameters",
        **dict.fromkeys(
            ("value_embed_betas", "value_embed_wd_mul", "value_embed_lr", "scalar_betas", "x0_betas"),
            "this model lacks the part the key's row trains",
        ),
        **dict.fromkeys(("gate_betas", "normuon_gate_row_stats"), "no gates in a gpt2024 model"),
    },
}
# the walk gives muon_ns_dtype=bf16 (the first choice unlike the recipes' auto): on a host with fast bf16
# that is what auto chose, so the weights stay bit-equal; without it bf16 iterations replace fp32 ones
HOSTS = {"fast-bf16": True, "slow-bf16": False}
INERT_WHERE = {
    "fast-bf16": {"muon_ns_dtype": "auto is bf16 here: bf16 given is the same choice"},
    "slow-bf16": {},
}


def _stepped(recipe: str, overrides: list[str]) -> list[torch.Tensor]:
    """The weights validation sees after 3 scheduled steps on fixed gradients."""
    cfg = load_recipe(recipe, [*TINY, *overrides])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        apply_schedule(schedule_at(step, cfg), opt, model)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    with opt.readout():
        return [p.detach().clone() for p in model.parameters()]


# on a host without fast bf16 (this project's AVX2 CI) the fast-bf16 walk emulates bf16: ~100x slower
CASES = [
    pytest.param(recipe, host, marks=[pytest.mark.slow] if fast else [])
    for recipe in sorted(INERT)
    for host, fast in HOSTS.items()
]


@pytest.mark.parametrize(("recipe", "host"), CASES)
def test_an_optim_key_that_changes_nothing_is_a_row_or_explained(recipe, host, monkeypatch):
    monkeypatch.setattr(optim_build, "fast_bf16", lambda _type: (HOSTS[host], f"a {host} host (test)"))
    assert optim_build.muon_ns_dtype("auto", torch.device("cpu")) == (
        torch.bfloat16 if HOSTS[host] else torch.float32
    )
    before, hints = _stepped(recipe, []), field_types(OptimConfig)
    tiny = load_recipe(recipe, TINY).optim
    inert = []
    for f in dataclasses.fields(OptimConfig):
        if f.name in ("name", "labels") or dataclasses.is_dataclass(hints[f.name]):
            continue  # a part table (optim.ships: acts at the run's end, fidelity/test_terminal_ships.py)
        try:
            after = _stepped(recipe, [f"optim.{f.name}={cli(other(getattr(tiny, f.name), hints[f.name]))}"])
        except ConfigError:
            continue  # refused: by its row of NEEDS or another rule
        if all(torch.equal(a, b) for a, b in zip(before, after, strict=True)):
            inert.append(f.name)
    assert sorted(inert) == sorted({**INERT[recipe], **INERT_WHERE[host]}), " ".join(inert)
