"""MuonH (optim.muon_hyperball, optim/pinned_muon.hyperball_step) against track 3's per-optimizer result
#5/#37 (records/track_3_optimization/results/20260611_muonh_tuned_aux_3250/, its
train_gpt_simple_muonh_tuned_aux_3250.py):
its `scale_invariant_update_` and `MuonH.step`, written here from its code, in fp64."""

from __future__ import annotations

import pytest
import torch

from speedrun.errors import ConfigError
from speedrun.optim.pinned_muon import PinnedMuon, hyperball_step
from speedrun.recipes import load_recipe
from tests.fidelity.refs import newton_schulz


def record_scale_invariant_update_(param, update, lr, eps=1e-10):
    p_norm = param.norm()
    u_norm = update.norm()
    new_param = param - lr * update * p_norm / torch.clamp(u_norm, min=eps)
    new_norm = torch.clamp(new_param.norm(), min=eps)
    param.copy_(new_param / new_norm * p_norm)


def record_muonh_step(p, momentum, lr, mu=0.95):
    """MuonH.step for one matrix (muon_update, then scale_invariant_update_)."""
    grad = p.grad.clone()
    momentum.lerp_(grad, 1 - mu)
    update = grad.lerp_(momentum, mu)
    update = newton_schulz.track3_simple(update, dtype=None)
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    record_scale_invariant_update_(p, update, lr)


def test_the_step_alone_is_the_records():
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(6, 4, dtype=torch.float64, generator=gen)
    u = torch.randn(6, 4, dtype=torch.float64, generator=gen)
    ours, ref = p.clone(), p.clone()
    hyperball_step(ours, u, 0.018)
    record_scale_invariant_update_(ref, u, 0.018)
    torch.testing.assert_close(ours, ref, rtol=1e-14, atol=0)
    assert ours.norm().item() == pytest.approx(p.norm().item(), rel=1e-14)
    assert not torch.allclose(ours, p - 0.018 * u)  # not a plain step


@pytest.mark.parametrize("shape", [(8, 4), (4, 8)])
def test_pinned_muon_with_hyperball_steps_as_muonh(shape):
    gen = torch.Generator().manual_seed(1)
    ours = torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64, generator=gen))
    ref = ours.detach().clone()
    opt = PinnedMuon(
        [{"params": [ours]}], lr=0.018, momentum=0.95, hyperball=True, ns_steps=12, ns_form="2024-11-10",
        ns_coefficients=(2.0, -1.5, 0.5), ns_dtype=torch.float64,
    )  # fmt: skip
    momentum = torch.zeros_like(ref)
    for _ in range(4):
        g = torch.randn(*shape, dtype=torch.float64, generator=gen)
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        record_muonh_step(ref, momentum, 0.018)
    torch.testing.assert_close(ours.detach(), ref, rtol=1e-10, atol=1e-12)
    # the same run without the switch (Muon's plain step) is told apart
    plain = torch.nn.Parameter(ref.clone())
    plain.grad = g.clone()
    PinnedMuon([{"params": [plain]}], lr=0.018, ns_steps=12, ns_form="2024-11-10",
               ns_coefficients=(2.0, -1.5, 0.5), ns_dtype=torch.float64).step()  # fmt: skip
    check = ref.clone()
    check.grad = g.clone()
    record_muonh_step(check, torch.zeros_like(ref), 0.018)
    assert not torch.allclose(plain.detach(), check, rtol=1e-6, atol=0)


def test_the_switch_on_the_baseline_and_its_refusals():
    cfg = load_recipe("track3-baseline", ["optim.muon_hyperball=true", "optim.muon_weight_decay=0"])
    assert cfg.optim.muon_hyperball
    with pytest.raises(ConfigError, match="muon_hyperball"):
        load_recipe("track3-baseline", ["optim.muon_hyperball=true"])  # the baseline's decay 0.05
