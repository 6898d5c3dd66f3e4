"""PowerCool (optim.power_cool_*, train/schedule.py) against record #46's `_lr` and `set_hparams`
(records/track_3_optimization/results/20260619_cwd_rowfloor_tailema/train_gpt_cwd_SOTA.py): every group's
LR at every step of the recipe, each group with its own constant, found by its parameters' labels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from speedrun.model.families import build_model
from speedrun.model.labels import label_of
from speedrun.optim.build import build_optimizer
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_schedule, schedule_at

#: #46's FINAL_SCHEDULE_STEPS, FINAL_LR_POWER and (initial LR, power_c) per group
T_END, POWER = 2900, 1.2
RECORD = {
    "embed": (0.3, 4.976805410800738e-05),  # optimizer1 group 0: ADAM_EMBED_POWER_C
    "head": (1 / 320, 5.184172302917436e-07),  # optimizer1 group 1: ADAM_PROJ_POWER_C
    "scalar": (0.01, 1.6589351369335795e-06),  # optimizer3's three aux groups: ADAM_OTHER_POWER_C
    "matrix": (0.0375, 3.3169534699576625e-06),  # optimizer2: MUON_POWER_C
}


def record_lr(step: int, initial_lr: float, power_c: float) -> float:
    """#46's _lr: min(flat, power_c · max(0, t_end − step)^power)."""
    return min(initial_lr, power_c * max(0.0, T_END - step) ** POWER)


def group_kind(group) -> str:
    label = label_of(group["params"][0]).name
    matrices = dict.fromkeys(("qkv", "attn_out", "mlp_in", "mlp_out"), "matrix")
    return (matrices | dict.fromkeys(("bias", "attn_out_bias"), "scalar")).get(label, label)  # optimizer3's


def tiny(*overrides: str):
    cfg = load_recipe("track3-2026-06", list(overrides))
    model = build_model(dataclasses.replace(cfg.model, n_layer=2, n_head=1, n_embd=32, vocab_size=64))
    return cfg, model, build_optimizer(model, cfg)


def test_every_groups_lr_at_every_step_is_the_records():
    cfg, model, opt = tiny()
    assert cfg.optim.power_cool_end == T_END and cfg.train.warmdown_frac == 0  # flat, then PowerCool
    kinds = {group_kind(g) for g in opt.param_groups}
    assert kinds == set(RECORD)
    for step in range(cfg.train.steps):
        apply_schedule(schedule_at(step, cfg), opt, model)
        for group in opt.param_groups:
            want = record_lr(step, *RECORD[group_kind(group)])
            assert group["lr"] == pytest.approx(want, rel=1e-12), (step, group_kind(group))
    # the knees: each group leaves its flat LR at its own step (Muon ~514, Adam's aux ~1,487)
    knees = {k: next(s for s in range(T_END) if record_lr(s, *v) < v[0]) for k, v in RECORD.items()}
    assert knees["matrix"] < 600 and 1400 < knees["scalar"] < 1600, knees


def test_a_constant_on_the_wrong_group_is_told():
    """Swapping the head's and the scalars' constants changes their LRs (the test above would fail)."""
    c = load_recipe("track3-2026-06").optim.power_cool_c
    swapped = f"optim.power_cool_c=[{c[0]}, {c[3]}, {c[2]}, {c[1]}]"
    cfg, model, opt = tiny(swapped)
    apply_schedule(schedule_at(2000, cfg), opt, model)
    got = {group_kind(g): g["lr"] for g in opt.param_groups}
    assert got["head"] != pytest.approx(record_lr(2000, *RECORD["head"]), rel=1e-6)


def test_off_it_leaves_the_schedule_alone():
    cfg, model, opt = tiny("optim.power_cool_end=0", "train.warmdown_frac=0.7")
    apply_schedule(schedule_at(2000, cfg), opt, model)
    multiplier = schedule_at(2000, cfg).lr
    assert all(g["lr"] == pytest.approx(g["initial_lr"] * multiplier) for g in opt.param_groups)
    assert all("power_c" not in g for g in opt.param_groups)
    assert torch.isfinite(torch.tensor(schedule_at(2000, cfg).power_cool)).item() is False
