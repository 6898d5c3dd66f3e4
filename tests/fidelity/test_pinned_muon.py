"""#46's optimizer switches (optim/pinned_muon.py, optim/tail_ema.py) against the record's lines
(records/track_3_optimization/results/20260619_cwd_rowfloor_tailema/train_gpt_cwd_SOTA.py), written
here in fp64 (its `.float()` as `.double()`), on the same random matrices; each check also runs with
the switch's number wrong and must then fail."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from speedrun.model.labels import label
from speedrun.optim import pinned_muon as pm
from speedrun.optim.tail_ema import TailEMA
from tests.fidelity.refs import newton_schulz as ns_refs

D = torch.float64


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D) * scale


# ---------------------------------------------------------------- the record's lines, in fp64


def r_gram(G, eps=1e-10):
    X = G.double()
    gram = X.mT @ X if X.size(-2) > X.size(-1) else X @ X.mT
    return gram.norm(dim=(-2, -1)).sqrt().clamp_min(eps)


def r_eigenbasis(mat):
    _, q = torch.linalg.eigh(mat + 1e-30 * torch.eye(mat.size(0), dtype=D))
    return torch.flip(q, [1])


def r_basis_qr(row_gg, col_gg, q_row, q_col, exp_avg_sq):
    row_sort = torch.argsort(torch.diag(q_row.T @ row_gg @ q_row), descending=True)
    q_row = q_row[:, row_sort]
    exp_avg_sq = exp_avg_sq.index_select(0, row_sort)
    q_row, _ = torch.linalg.qr(row_gg @ q_row)
    col_sort = torch.argsort(torch.diag(q_col.T @ col_gg @ q_col), descending=True)
    q_col = q_col[:, col_sort]
    exp_avg_sq = exp_avg_sq.index_select(1, col_sort)
    q_col, _ = torch.linalg.qr(col_gg @ q_col)
    return q_row, q_col, exp_avg_sq


def r_precondition(update, state, beta2, eps=1e-8):
    if state["q_row"] is None:
        return update
    q_row, q_col = state["q_row"], state["q_col"]
    projected = q_row.T @ update @ q_col
    state["exp_avg_sq"].mul_(beta2).add_(projected.square(), alpha=1 - beta2)
    denom = state["exp_avg_sq"].clamp_min(eps * eps).pow(0.5)
    precond = q_row @ (projected / denom) @ q_col.T
    precond.mul_(r_gram(update, eps=eps) / r_gram(precond, eps=eps))
    return precond


def r_observe(grad, state, beta2, freq=1):
    state["row_gg"].lerp_(grad @ grad.T, 1 - beta2)
    state["col_gg"].lerp_(grad.T @ grad, 1 - beta2)
    if state["q_row"] is None:
        state["q_row"], state["q_col"] = r_eigenbasis(state["row_gg"]), r_eigenbasis(state["col_gg"])
    elif state["soap_step"] > 0 and state["soap_step"] % freq == 0:
        state["q_row"], state["q_col"], state["exp_avg_sq"] = r_basis_qr(
            state["row_gg"], state["col_gg"], state["q_row"], state["q_col"], state["exp_avg_sq"]
        )
    state["soap_step"] += 1


def r_state(rows, cols):
    z = dict(dtype=D)
    return dict(exp_avg_sq=torch.zeros(rows, cols, **z), row_gg=torch.zeros(rows, rows, **z),
                col_gg=torch.zeros(cols, cols, **z), q_row=None, q_col=None, soap_step=0)  # fmt: skip


def r_cos(a, b, eps=1e-8):
    return (a * b).sum() / (a.norm() * b.norm()).clamp_min(eps)


def r_trust(raw, soap, grad, step, eps=1e-8):
    agree = ((r_cos(soap, raw) - 0.20) / (1 - 0.20)).clamp(0, 1)
    grad_gate = ((r_cos(soap, grad) - 0.0) / (r_cos(raw, grad) - 0.0).clamp_min(eps)).clamp(0, 1)
    gate = (agree * grad_gate).clamp(0, 1)
    if step < 1375:
        floor = 0.45
    elif step >= 1625:
        floor = 0.0
    else:
        floor = 0.45 * (1625 - step) / (1625 - 1375)
    return gate.clamp(min=floor, max=0.85 if step < 1625 else 1.0)


def r_blend(raw, soap, gate, eps=1e-8):
    blended = raw + (soap - raw) * gate
    return blended * (r_gram(raw, eps=eps) / r_gram(blended, eps=eps))


def r_radial(update, param, eps=1e-12):
    coeff = (update * param).sum() / (param * param).sum().clamp_min(eps)
    radial = coeff * param
    scale = torch.where(coeff < 0, update.new_tensor(0.5), update.new_tensor(1.0))
    return update - radial + scale * radial


def r_floor(update, p, target, rowfloor):
    if rowfloor:
        r_row = p.norm(dim=1, keepdim=True).clamp_min(1e-8)
        s_row = update.norm(dim=1, keepdim=True).clamp_min(1e-8)
        return update * torch.clamp(target * r_row / s_row, min=1.0).pow(1.0)
    p_fro, u_fro = p.norm().clamp_min(1e-8), update.norm().clamp_min(1e-8)
    return update * torch.where(u_fro / p_fro < target, target * p_fro / u_fro, torch.ones_like(p_fro))


def r_apply(p, update, lr, cwd, eps=1e-8):
    before = p.norm().clamp_min(eps)
    target = (before + (-lr * (update * p).sum() / before)).clamp_min(eps)
    mask = (update * p > 0).to(p.dtype)
    p.add_(update, alpha=-lr)
    p.mul_(target / p.norm().clamp_min(eps))
    if cwd > 0:
        p.mul_(1.0 - (lr * cwd) * mask)


# ---------------------------------------------------------------- SOAP


def _soap_run(beta2_ours: float, steps: int = 4):
    shape = (24, 16)
    ref, ours = r_state(*shape), pm.soap_state(torch.zeros(shape, dtype=D))
    out = []
    for s in range(steps):
        g, d = rand(*shape, seed=s), rand(*shape, seed=100 + s)
        want, got = r_precondition(d, ref, 0.9), pm.soap_precondition(d, ours, beta2_ours)
        r_observe(g, ref, 0.9)
        pm.soap_observe(g, ours, beta2_ours)
        out.append((got, want))
    return out


def test_soap_precondition_and_bases_follow_the_record():
    pairs = _soap_run(0.9)
    assert torch.equal(pairs[0][0], pairs[0][1])  # no basis at the first step: the update itself
    for got, want in pairs[1:]:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(pairs[-1][0], rand(24, 16, seed=103))  # the preconditioner acts


def test_soap_with_a_wrong_beta2_is_caught():
    pairs = _soap_run(0.95)
    assert not torch.allclose(pairs[-1][0], pairs[-1][1], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("step", [0, 1400, 1500, 1700])
@pytest.mark.parametrize("sign", [1.0, -1.0])  # SOAP with the momentum (gate inside its bounds) or against it
def test_trust_gate_and_blend_follow_the_record(step, sign, monkeypatch):
    raw, grad = rand(16, 24, seed=1), rand(16, 24, seed=2)
    soap = sign * raw + 0.8 * rand(16, 24, seed=3)
    gate = pm.trust_gate(raw, soap, grad, step)
    want = r_trust(raw, soap, grad, step)
    torch.testing.assert_close(gate, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(pm.blend(raw, soap, gate), r_blend(raw, soap, gate), rtol=1e-12, atol=1e-14)
    if sign < 0 and step < 1625:  # the early floor binds: a wrong floor is caught
        monkeypatch.setattr(pm, "EARLY_FLOOR", 0.5)
        assert not torch.allclose(pm.trust_gate(raw, soap, grad, step), want)


# ---------------------------------------------------------------- pin, floor, cautious decay


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("sign", [1.0, -1.0])  # inward and outward radial parts
def test_brake_floor_pin_and_post_pin_cwd_follow_the_record(rows, sign):
    p = rand(16, 24, seed=4)
    u = rand(16, 24, seed=5, scale=0.05) + sign * 0.3 * p  # small: the floor lifts some rows
    lr, target, cwd = 0.03, 0.3825, 0.025
    want_u = r_floor(r_radial(u, p), p, target, rows)
    got_u = pm.uw_floor(pm.radial_brake(u, p), p, target, rows)
    torch.testing.assert_close(got_u, want_u, rtol=1e-12, atol=1e-14)
    want_p, got_p = p.clone(), p.clone()
    r_apply(want_p, want_u, lr, cwd)
    pm.pinned_step(got_p, got_u, lr, pin=True, cwd=cwd)
    torch.testing.assert_close(got_p, want_p, rtol=1e-12, atol=1e-14)
    # each number wired wrong is caught
    assert not torch.allclose(pm.uw_floor(pm.radial_brake(u, p), p, target, not rows), want_u)
    wrong = p.clone()
    pm.pinned_step(wrong, got_u, lr, pin=True, cwd=0.05)
    assert not torch.allclose(wrong, want_p, rtol=1e-10, atol=1e-12)
    unpinned = p.clone()
    pm.pinned_step(unpinned, got_u, lr, pin=False, cwd=cwd)
    assert not torch.allclose(unpinned, want_p, rtol=1e-10, atol=1e-12)


def test_the_optimizer_chains_them_as_the_record():
    """PinnedMuon with every switch on (fp64, SVD orthogonalization so the chain is exact) against the
    record's Muon.step body for an attention output (trust gate), a Q (blend) and an MLP matrix."""
    shapes = {"trust": (16, 24), "blend": (16, 16), "none": (24, 16)}
    params = {k: nn.Parameter(rand(*s, seed=10 + i)) for i, (k, s) in enumerate(shapes.items())}
    groups = [dict(params=[p], gate=k) for k, p in params.items()]
    opt = pm.PinnedMuon(groups, lr=0.03, soap=True, soap_beta2=0.9, uw_floor=0.3825, row_floor=True,
                        pin=True, cwd=0.025, backend="svd")  # fmt: skip
    ref = {k: (p.detach().clone(), torch.zeros_like(p), r_state(*p.shape)) for k, p in params.items()}
    for step in range(4):
        for i, (k, p) in enumerate(params.items()):
            g = rand(*p.shape, seed=50 + 10 * step + i)
            p.grad = g.clone()
            w, m, st = ref[k]
            m.lerp_(g, 1 - 0.95)
            d = g.lerp(m, 0.95)
            s = r_precondition(d, st, 0.9)
            if k == "none":
                d = s
            else:
                d = r_blend(d, s, r_trust(d, s, g, step) if k == "trust" else torch.ones((), dtype=D))
            u, _, vh = torch.linalg.svd(d, full_matrices=False)
            update = (u @ vh) * max(1, d.size(-2) / d.size(-1)) ** 0.5
            update = r_floor(r_radial(update, w), w, 0.3825, True)
            r_apply(w, update, 0.03, 0.025)
            r_observe(g, st, 0.9)
        opt.step()
    for k, p in params.items():
        torch.testing.assert_close(p.detach(), ref[k][0], rtol=1e-9, atol=1e-11, msg=k)


# ---------------------------------------------------------------- Tail-EMA


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = label(nn.Parameter(rand(5, 3, seed=20)), "embed")
        self.w = label(nn.Parameter(rand(3, 3, seed=21)), "matrix")


def test_tail_ema_follows_the_record():
    """ema lazily set at start, ema += (w − ema)/tau until end; readout (1 − λ)w + λ·ema, the token
    embedding left out; the weights restored after."""
    model = Two()
    tail = TailEMA(model, start=3, end=7, tau=4.0, lam=0.6)
    ema = None
    for step in range(9):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rand(*p.shape, seed=30 + step, scale=0.1))
        tail.after_step(step)
        if 3 <= step + 1 < 7:  # the record's lines
            w = model.w.detach()
            ema = w.clone() if ema is None else ema + (w - ema) / 4.0
        stash_w, stash_e = model.w.detach().clone(), model.embed.detach().clone()
        with tail.readout() as active:
            assert active == (ema is not None)
            if ema is not None:
                want = (1.0 - 0.6) * stash_w + 0.6 * ema
                torch.testing.assert_close(model.w.detach(), want, rtol=1e-12, atol=0)
                assert torch.equal(model.embed.detach(), stash_e)
        assert torch.equal(model.w.detach(), stash_w) and torch.equal(model.embed.detach(), stash_e)
    wrong = TailEMA(Two(), start=3, end=7, tau=8.0, lam=0.6)
    for step in range(9):
        with torch.no_grad():
            for p in wrong.params:
                p.add_(rand(*p.shape, seed=30 + step, scale=0.1))
        wrong.after_step(step)
    assert not torch.allclose(wrong.ema[0], ema)


# ---------------------------------------------------------------- the recipe's optimizer


def test_the_recipe_groups_matrices_by_label_and_its_state_round_trips():
    """track3-2026-06: attention outputs through the trust gate, q/k/v blended, the MLP plain; a saved
    state loaded into a new optimizer continues bit for bit."""
    from speedrun.model.gpt2024.model import GPT
    from speedrun.optim.build import build_optimizer
    from speedrun.recipes import load_recipe

    cfg = load_recipe("track3-2026-06", ["model.n_layer=2", "model.n_embd=64", "model.n_head=2",
                                         "model.vocab_size=128", "optim.muon_ns_dtype=fp32"])  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg)
    muon = opt.parts["muon"]
    gate_of = {id(p): g["gate"] for g in muon.param_groups for p in g["params"]}
    names = {n: gate_of.get(id(p)) for n, p in model.named_parameters()}
    assert names["blocks.0.attn.c_proj.weight"] == "trust" and names["blocks.1.attn.c_k.weight"] == "blend"
    assert names["blocks.0.mlp.c_fc.weight"] == names["blocks.0.mlp.c_proj.weight"] == "none"
    assert names["blocks.0.attn.c_q.bias"] is None and names["lm_head.weight"] is None  # Adam's
    x = torch.randint(0, 128, (2, 32))

    def step(o):
        model(x, x).backward()
        o.step()
        o.zero_grad()

    for _ in range(2):
        step(opt)
    saved = ({n: p.detach().clone() for n, p in model.named_parameters()}, copy.deepcopy(opt.state_dict()))
    step(opt)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[0][n])
    fresh = build_optimizer(model, cfg)
    fresh.load_state_dict(saved[1])
    assert fresh.parts["muon"].steps == 2
    step(fresh)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), after[n]), n


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["model.fused_qkv=true"], "need optim.name=muon and model.fused_qkv=false"),
        (
            ["optim.muon_uw_floor=0", "optim.muon_row_floor=true"],
            "optim.muon_row_floor=true has no effect while optim.muon_uw_floor=0.0",
        ),
        (
            ["optim.muon_radius_pin=false", "optim.muon_post_pin_cwd=0.01"],
            "optim.muon_post_pin_cwd=0.01 has no effect while optim.muon_radius_pin=false",
        ),
        (
            ["optim.tail_ema_end=100"],
            "optim.tail_ema_tau needs 1 <= optim.tail_ema_start < optim.tail_ema_end",
        ),
        (["optim.muon_soap_beta2=1.5"], "optim.muon_soap_beta2"),
        (["optim.ema_nesterov_end=100"], "it needs optim.name=muon and 0 <= optim.ema_nesterov_start <"),
        (["optim.power_cool_c=[0, 1, 1, 1]"], "optim.power_cool_c, four coefficients > 0"),
        (["optim.adam_weight_decay=0.01"], "optim.scalar_bias_correction=false (#46's aux Adam) needs"),
        (["optim.muon_hyperball=true"], "optim.muon_hyperball (MuonH) keeps"),
        (["model.norm=rmsnorm"], "model.cgi_gain_alpha (#46's CGI gain init) needs model.norm=rmsnorm-gain"),
    ],
)
def test_bad_track3_switches_are_one_line_config_errors(overrides, fragment):
    from speedrun.errors import ConfigError
    from speedrun.recipes import load_recipe

    with pytest.raises(ConfigError) as info:
        load_recipe("track3-2026-06", overrides)
    assert fragment in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------- #46's Newton-Schulz


@pytest.mark.parametrize("shape", [(32, 48), (48, 32)])
def test_the_2026_06_newton_schulz_is_the_records(shape):
    from speedrun.optim import newton_schulz

    g = rand(*shape, seed=7).float()
    for steps in (12, 2):  # after 2 steps the normalization still shows: the Frobenius one is caught
        want = ns_refs.record_46(g, steps)
        got = newton_schulz(g, steps, (2.0, -1.5, 0.5), form="2026-06", dtype=torch.bfloat16)
        assert torch.equal(got, want)
    frobenius = newton_schulz(g, 2, (2.0, -1.5, 0.5), form="2024-11-10", dtype=torch.bfloat16)
    assert not torch.allclose(frobenius.float(), want.float(), rtol=0.05, atol=0)
