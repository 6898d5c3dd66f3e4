"""Bias-correction-free Adam (optim/plain_adam.py, optim.scalar_bias_correction=false) against record #46's
aux `Adam` class (records/track_3_optimization/results/20260619_cwd_rowfloor_tailema/train_gpt_cwd_SOTA.py),
written here from its code, in fp64; and where a run puts it: the scalar group of the track-3 Muon, a
part of its own, scheduled and PowerCooled like the other Adam groups."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from speedrun.model.families import build_model
from speedrun.model.labels import label_of
from speedrun.optim.build import build_optimizer
from speedrun.optim.plain_adam import PlainAdam
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_schedule, schedule_at


@torch.no_grad()
def record_adam_step(params, state, lr, betas, eps):
    """#46's Adam.step (one group): raw EMAs, no (1 − β^t) correction."""
    beta1, beta2 = betas
    for p in params:
        st = state.setdefault(id(p), {})
        if not st:
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
        st["exp_avg"].lerp_(p.grad, 1 - beta1)
        st["exp_avg_sq"].lerp_(p.grad.square(), 1 - beta2)
        adam_dir = st["exp_avg"] / (st["exp_avg_sq"].sqrt() + eps)
        p.add_(adam_dir, alpha=-lr)


def run(opt_factory, steps=8):
    torch.manual_seed(0)
    params = [torch.randn(7, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    opt = opt_factory(params)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 1e-3 + 0.1 * p
        lr = 0.01 * (1 - step / 10)
        if isinstance(opt, torch.optim.Optimizer):
            opt.param_groups[0]["lr"] = lr
            opt.step()
        else:
            opt(params, lr)
    return params


def test_plain_adam_in_fp64_equals_the_records_class():
    state: dict = {}
    ref = run(lambda ps: lambda params, lr: record_adam_step(params, state, lr, (0.8, 0.997), 1e-10))
    ours = run(lambda ps: PlainAdam(ps, lr=0.01, betas=(0.8, 0.997), eps=1e-10))
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)
    # torch's Adam corrects the bias: the reference tells it apart
    torch_adam = run(lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.997), eps=1e-10))
    assert not torch.allclose(torch_adam[0], ref[0], rtol=1e-6, atol=0)


def test_the_run_steps_the_scalars_with_it():
    cfg = load_recipe("track3-2026-06", ["optim.scalar_bias_correction=false"])
    model = build_model(dataclasses.replace(cfg.model, n_layer=2, n_head=1, n_embd=32, vocab_size=64))
    opt = build_optimizer(model, cfg)
    plain = opt.parts["scalar"]
    # #46's optimizer3: the gains at beta2 0.99, the biases at 0.997, the attention output's at 0.9965
    assert isinstance(plain, PlainAdam) and len(plain.param_groups) == 3
    labels = [{label_of(p).name for p in g["params"]} for g in plain.param_groups]
    assert labels == [{"scalar"}, {"bias"}, {"attn_out_bias"}]
    assert [g["betas"] for g in plain.param_groups] == [(0.8, 0.99), (0.8, 0.997), (0.8, 0.9965)]
    scalar_like = {"scalar", "bias", "attn_out_bias"}
    assert all(
        label_of(p).name not in scalar_like for g in opt.parts["adam"].param_groups for p in g["params"]
    )
    apply_schedule(schedule_at(2000, cfg), opt, model)  # PowerCool: the aux groups' constant
    c, lr0 = cfg.optim.power_cool_c[3], cfg.optim.scalar_lr
    for group in plain.param_groups:
        assert group["lr"] == pytest.approx(min(lr0, c * (2900 - 2000) ** 1.2), rel=1e-12)
        assert group["eps"] == cfg.optim.eps
    assert plain.param_groups[0]["betas"] == tuple(cfg.optim.betas)
    # the embedding and head stay in torch's (bias-corrected) Adam; the checkpoint keeps the three parts
    assert set(opt.state_dict()) >= {"adam", "muon", "scalar"}
