"""`bos-align-2025-07` runs record #26's optimizer on our sharded path: three steps of the recipe's
optimizer (optim.name = "normuon", no DDP) against #26's Muon and DistAdam written here from its code
(records/track_1_short/2025-07-12_BosAlign, the code at the top of each log) on one process, where its
reduce-scatter averages over one rank; the same gradients, each step's LR and momentum from #26's
formulas. Record #26 runs Newton-Schulz in bf16: the bf16 case checks its op order too."""

from __future__ import annotations

import pytest
import torch

from speedrun.model.families import build_model
from speedrun.model.gpt2024.model import GPT
from speedrun.optim.build import build_optimizer, sharded_optimizer
from speedrun.optim.sharded import ShardedNorMuonAdam
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_schedule, schedule_at
from tests.fidelity.refs import newton_schulz
from tests.fidelity.test_bos_align_recipe import record_lr
from tests.recipe_matrix import shrink

RECIPE = "bos-align-2025-07"


@torch.no_grad()
def record_muon_step(params, state, lr, momentum, ns_dtype):
    """#26's Muon.step for world_size 1 (weight decay 0, no lr_mul on the matrices)."""
    for p in params:
        grad = p.grad
        eff_lr = lr * max(1, p.size(-2) / p.size(-1)) ** 0.5
        buf = state.setdefault(id(p), torch.zeros_like(grad))
        p.mul_(1 - 0.0)
        buf.lerp_(grad, 1 - momentum)
        grad = grad.lerp_(buf, momentum)
        v = newton_schulz.record_26(grad.to(ns_dtype), 5)
        p.add_(other=v, alpha=-eff_lr)


@torch.no_grad()
def record_adam_step(params, state, lr, betas=(0.8, 0.95), eps=1e-10):
    """#26's DistAdam.step for world_size 1 (weight decay 0): lr·lr_mul per parameter."""
    beta1, beta2 = betas
    for p in params:
        st = state.setdefault(id(p), {})
        if not st:
            st["step"] = torch.tensor(0, dtype=torch.int64)
            st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        st["step"] += 1
        t = st["step"]
        g = p.grad
        st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
        st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1, bias2 = 1 - beta1**t, 1 - beta2**t
        denom = st["exp_avg_sq"].sqrt().add_(eps)
        step_size = lr * p.lr_mul * (torch.sqrt(bias2) / bias1)
        update = st["exp_avg"].div(denom).mul_(step_size)
        p.add_(other=update, alpha=-1.0)


def record_params(model: GPT) -> tuple[list, list, dict]:
    """Copies of the weights sorted as #26 sorts them: hidden matrices (the fused QKV as its
    (3, d, d) qkv_w) for Muon, everything else for DistAdam with its lr_mul."""
    muon, adam, copies = [], [], {}
    for name, p in model.named_parameters():
        w = p.detach().clone()
        if name.endswith("attn.c_attn.weight"):
            w = w.view(3, -1, w.shape[-1])
        w = torch.nn.Parameter(w)
        copies[name] = w
        if name.startswith("blocks.") and p.ndim >= 2:
            muon.append(w)
        else:
            # the record's lr_mul: embed and value_embeds 75 (our wte is its embed), lm_head 27.5, scalars 5
            embed = "embed" in name or name.startswith("wte.")
            w.lr_mul = 75.0 if embed else 27.5 if name.startswith("lm_head") else 5.0
            adam.append(w)
    return muon, adam, copies


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_three_steps_equal_record_26s_optimizer(ns_dtype):
    extra = ["model.embed_dtype=fp32", "model.fp8_head=false", f"optim.muon_ns_dtype={ns_dtype}"]
    cfg = load_recipe(RECIPE, [*shrink(RECIPE), *extra])
    assert sharded_optimizer(cfg)  # no DDP around the model
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg)
    assert list(opt.parts) == ["table"] and isinstance(opt.parts["table"], ShardedNorMuonAdam)
    muon, adam, copies = record_params(model)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert len(muon) == sum(1 for n in copies if n.startswith("blocks.") and copies[n].ndim >= 2)
    muon_state, adam_state = {}, {}
    gen = torch.Generator().manual_seed(1)
    n = cfg.train.steps
    for step in (0, 5, 8):  # LR 1 then in the cool-down; momentum warming up
        apply_schedule(schedule_at(step, cfg), opt, model)
        for name, p in model.named_parameters():
            g = torch.randn(p.shape, generator=gen)
            p.grad = g.clone()
            copies[name].grad = g.view_as(copies[name]).clone()
        opt.step()
        opt.zero_grad()
        frac = min(step / 300, 1)
        record_adam_step(adam, adam_state, 0.008 * record_lr(step, n))
        record_muon_step(muon, muon_state, 0.05 * record_lr(step, n), (1 - frac) * 0.85 + frac * 0.95,
                         torch.bfloat16 if ns_dtype == "bf16" else torch.float32)  # fmt: skip
    for name, p in model.named_parameters():
        want = copies[name].detach().view_as(p) - start[name]
        got = p.detach() - start[name]
        # measured: <= 7e-7 (fp32 Adam bias corrections vs ours in double); the 2025 fused Newton-Schulz
        # order in bf16 would be 2.6% off, NorMuon's normalization 7%
        assert (got - want).norm() <= 2e-6 * want.norm(), name
