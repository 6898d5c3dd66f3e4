"""EMA-Nesterov (optim/ema_nesterov.py, optim.ema_nesterov_*) against record #46's `EMA_Nesterov` class
(records/track_3_optimization/results/20260619_cwd_rowfloor_tailema/train_gpt_cwd_SOTA.py), written here
from its code: alone in fp64 around an SGD, and wired into a run's optimizer (build_optimizer: the
lookahead's LR ratio, its place after the Tail-EMA, validation without it, the checkpoint state)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from speedrun.model.families import build_model
from speedrun.optim.build import build_optimizer
from speedrun.optim.ema_nesterov import EmaNesterov
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_schedule, schedule_at


class RecordEmaNesterov:
    """#46's EMA_Nesterov: nesterov_step before the forward, step (inner steps, then accum_lookahead)."""

    def __init__(self, params, inner, lookahead_stepsize, lookahead_ema, prefill_steps, rest_steps):
        self.params, self.inner = list(params), inner
        self.lookahead_stepsize, self.lookahead_ema = lookahead_stepsize, lookahead_ema
        self.prefill_steps, self.rest_steps = prefill_steps, rest_steps
        self.it, self.lookahead_status = 0, False
        self.prev = [p.clone() for p in self.params]
        self.buf = [torch.zeros_like(p) for p in self.params]

    def lr_lambda(self):
        group = self.inner.param_groups[0]
        return group["lr"] / group["initial_lr"]

    @torch.no_grad()
    def nesterov_step(self):
        if self.it + 1 > self.prefill_steps and self.it < self.rest_steps and not self.lookahead_status:
            stepsize = self.lookahead_stepsize * self.lr_lambda()
            for p, buf in zip(self.params, self.buf, strict=True):
                p.add_(buf, alpha=stepsize)
        self.lookahead_status = True

    @torch.no_grad()
    def step(self):
        assert self.lookahead_status
        self.inner.step()
        for i, p in enumerate(self.params):
            look = p.add(self.prev[i], alpha=-1)
            self.buf[i].lerp_(look, 1 - self.lookahead_ema)
            self.prev[i].copy_(p)
        self.lookahead_status = False
        self.it += 1


def grads_at(params, step):
    """A gradient that depends on where the weights are (so a lookahead changes it) and on the step."""
    return [
        0.3 * p + 0.1 * torch.cos(torch.arange(p.numel(), dtype=p.dtype).view_as(p) + step) for p in params
    ]


def lr_ratio(step):
    return 1.0 if step < 6 else 1.0 - 0.1 * (step - 5)


def test_alone_in_fp64_equals_the_records_class():
    torch.manual_seed(0)
    ours_p = [torch.randn(3, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    rec_p = [p.clone() for p in ours_p]
    ours_opt = torch.optim.SGD(ours_p, lr=0.1, momentum=0.9)
    rec_opt = torch.optim.SGD(rec_p, lr=0.1, momentum=0.9)
    for opt in (ours_opt, rec_opt):
        opt.param_groups[0]["initial_lr"] = 0.1
    ours = EmaNesterov(ours_p, 0.3, 0.9, start=2, end=9)
    rec = RecordEmaNesterov(rec_p, rec_opt, 0.3, 0.9, prefill_steps=2, rest_steps=9)
    looked = 0
    for step in range(12):
        with ours.readout():  # validation before step `step`: the record validates before nesterov_step
            for a, b in zip(ours_p, rec_p, strict=True):
                assert torch.equal(a, b), step
        rec.nesterov_step()
        looked += ours.active(step)
        for a, b in zip(ours_p, rec_p, strict=True):  # the forward's weights: with the lookahead
            assert torch.equal(a, b), step
        for p, g in zip(ours_p, grads_at(ours_p, step), strict=True):
            p.grad = g
        for p, g in zip(rec_p, grads_at(rec_p, step), strict=True):
            p.grad = g
        for opt in (ours_opt, rec_opt):
            opt.param_groups[0]["lr"] = 0.1 * lr_ratio(step)
        ours_opt.step()
        ours.after_update(ours_opt.param_groups[0]["lr"] / 0.1)
        rec.step()
    assert looked == 7 and any(b.abs().sum() > 0 for b in ours.buf)  # steps 2..8 looked ahead


@pytest.mark.parametrize("wrong", ["no lookahead", "beta 0.9"])
def test_the_reference_tells_a_wrong_setting(wrong):
    torch.manual_seed(0)
    ours_p = [torch.randn(3, 4, dtype=torch.float64)]
    rec_p = [ours_p[0].clone()]
    ours_opt, rec_opt = torch.optim.SGD(ours_p, lr=0.1), torch.optim.SGD(rec_p, lr=0.1)
    rec_opt.param_groups[0]["initial_lr"] = 0.1
    ours = EmaNesterov(
        ours_p, 1e-9 if wrong == "no lookahead" else 0.3, 0.9 if wrong == "beta 0.9" else 0.99, 1, 9
    )
    rec = RecordEmaNesterov(rec_p, rec_opt, 0.3, 0.99, 1, 9)
    for step in range(6):
        rec.nesterov_step()
        ours_p[0].grad, rec_p[0].grad = grads_at(ours_p, step)[0], grads_at(rec_p, step)[0]
        ours_opt.step()
        ours.after_update(1.0)
        rec.step()
    assert not torch.allclose(ours_p[0], rec_p[0], rtol=1e-6, atol=0)


TINY = dict(n_layer=2, n_head=1, n_embd=32, vocab_size=64, max_seq_len=16)


def tiny_track3(*overrides: str):
    cfg = load_recipe("track3-2026-06", ["train.steps=12", "train.dtype=fp32", *overrides])
    cfg.model = dataclasses.replace(cfg.model, **TINY)
    torch.manual_seed(0)
    model = build_model(cfg.model).double()
    with torch.no_grad():
        for p in model.parameters():  # the zero projections and head would hide the lookahead
            p.add_(torch.randn_like(p) * 0.02)
    return cfg, model


def test_wired_into_the_runs_optimizer_as_the_records_wrapper():
    """Our run (EMA-Nesterov inside build_optimizer, Tail-EMA on) against the record's wrapper around the
    same inner optimizers: the weights the forward sees, and those validation sees, at every step."""
    ema = ["optim.ema_nesterov_step=0.3", "optim.ema_nesterov_beta=0.9", "optim.ema_nesterov_start=2",
           "optim.ema_nesterov_end=10", "optim.tail_ema_start=3", "optim.tail_ema_end=9",
           "optim.tail_ema_tau=2", "train.warmdown_frac=0.5"]  # fmt: skip
    cfg, ours_model = tiny_track3(*ema)
    ref_cfg, ref_model = tiny_track3(*ema[4:], "optim.ema_nesterov_step=0")  # the record wraps this run
    ref_model.load_state_dict(ours_model.state_dict())
    ours, inner = build_optimizer(ours_model, cfg), build_optimizer(ref_model, ref_cfg)
    assert ours.nesterov is not None and inner.nesterov is None
    rec = RecordEmaNesterov(list(ref_model.parameters()), inner, 0.3, 0.9, 2, 10)
    x = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(3))
    for step in range(12):
        with ours.readout(), inner.readout():
            for (n, a), b in zip(ours_model.named_parameters(), ref_model.parameters(), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=f"validation {step} {n}")
        rec.nesterov_step()
        for model in (ours_model, ref_model):
            model(x, x).backward()
        for (n, a), b in zip(ours_model.named_parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-14, msg=f"forward {step} {n}")
        apply_schedule(schedule_at(step, cfg), ours, ours_model)
        apply_schedule(schedule_at(step, ref_cfg), inner, ref_model)
        ours.step()
        rec.step()
        ours.zero_grad()
        inner.zero_grad()
    state = ours.state_dict()["ema_nesterov"]
    assert state["steps"] == 12 and not state["pending"]
