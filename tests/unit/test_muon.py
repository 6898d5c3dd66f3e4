"""Muon on one device: backends against SVD, the optimizer against torch.optim.Muon and a hand-written
fp64 reference of the update rule, splitting, batching, state round trip and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from speedrun.optim import (
    POLAR_EXPRESS_COEFFICIENTS,
    SHAPE_SCALES,
    Muon,
    newton_schulz,
    orthogonalize,
    polar_express,
    set_muon_split,
    svd_orthogonalize,
)

# ---------------------------------------------------------------- Polar Express coefficients


def _minimax_odd_quintic(lo: float, hi: float) -> np.ndarray:
    """Remez exchange: the odd quintic closest to 1 in max norm on [lo, hi] (equioscillates 4 times)."""
    q, r = (3 * lo + hi) / 4, (lo + 3 * hi) / 4
    for _ in range(100):
        rows = [[x, x**3, x**5, s] for x, s in ((lo, 1), (q, -1), (r, 1), (hi, -1))]
        a, b, c, _ = np.linalg.solve(np.array(rows), np.ones(4))
        disc = math.sqrt(9 * b * b - 20 * a * c)  # extrema of p: roots of a + 3b x² + 5c x⁴
        q, r = math.sqrt((-3 * b - disc) / (10 * c)), math.sqrt((-3 * b + disc) / (10 * c))
    return np.array([a, b, c])


def test_polar_express_coefficients_follow_the_greedy_minimax_construction() -> None:
    lo, hi, cushion, safety, steps = 1e-3, 1.0, 0.02, 1.02, 5
    derived = []
    for k in range(steps):
        coef = _minimax_odd_quintic(max(lo, cushion * hi), hi)
        poly = lambda x, c=coef: c[0] * x + c[1] * x**3 + c[2] * x**5
        if cushion * hi > lo:  # the fit ignored [lo, cushion·hi]: recentre so p(lo) + p(hi) = 2
            coef = coef * 2 / (poly(lo) + poly(hi))
        if k < steps - 1:
            coef = coef / np.array([safety, safety**3, safety**5])
        lo = coef[0] * lo + coef[1] * lo**3 + coef[2] * lo**5
        hi = 2 - lo
        derived.append(coef)
    np.testing.assert_allclose(np.array(derived), np.array(POLAR_EXPRESS_COEFFICIENTS), rtol=1e-8)


# ---------------------------------------------------------------- singular-value bands


def _ill_conditioned(rows: int, cols: int, cond: float, gen: torch.Generator) -> torch.Tensor:
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen))
    return (u * torch.logspace(0, -math.log10(cond), k)) @ v.T


# (function, lowest input singular value relative to ‖G‖_F that must land in the band, band)
BANDS = {
    "newton_schulz": (newton_schulz, 2e-3, (0.65, 1.25)),  # measured [0.680, 1.203]
    "polar_express": (polar_express, 1e-3, (0.82, 1.17)),  # measured [0.851, 1.142]
}


# GPT-2's aspect ratios (768², 768×3072, 3072×768, 2304×768) at a sixth of the size: the band is a
# property of the polynomial and of bf16 rounding, and bf16 matmuls of GPT-2 size take minutes on a
# CPU without bf16 instructions (~0.3 GFLOP/s), where these take a second.
BAND_SHAPES = [(128, 128), (128, 512), (512, 128), (384, 128)]


@pytest.mark.parametrize("shape", BAND_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", ["gaussian", "cond1e6"])
@pytest.mark.parametrize("backend", list(BANDS))
def test_singular_values_land_in_documented_band(backend: str, kind: str, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    g = torch.randn(*shape, generator=gen) if kind == "gaussian" else _ill_conditioned(*shape, 1e6, gen)
    fn, threshold, (lo, hi) = BANDS[backend]
    out = fn(g)
    assert out.dtype == torch.bfloat16 and out.shape == g.shape
    s_in = torch.linalg.svdvals(g) / torch.linalg.matrix_norm(g)
    s_out = torch.linalg.svdvals(out.float())
    assert s_out.max() <= hi
    # Each output value is the iteration's scalar map applied to one input value, so with k inputs
    # below the threshold, at most k outputs may fall under the band.
    big = int((s_in >= threshold).sum())
    assert big > 0 and s_out[big - 1] >= lo, f"{big}-th largest output singular value {s_out[big - 1]:.3f}"


@pytest.mark.parametrize("shape", [(96, 64), (64, 160)])
def test_svd_backend_returns_the_polar_factor(shape: tuple[int, int]) -> None:
    g = torch.randn(*shape)
    o = svd_orthogonalize(g)
    assert o.dtype == torch.float32
    k = min(shape)
    gram = o.T @ o if shape[0] >= shape[1] else o @ o.T
    torch.testing.assert_close(gram, torch.eye(k), atol=2e-5, rtol=0)
    # G = O·P with P = Oᵀ G symmetric positive definite (the polar decomposition), for tall G.
    if shape[0] >= shape[1]:
        p = o.T @ g
        torch.testing.assert_close(p, p.T, atol=1e-4, rtol=0)
        assert torch.linalg.eigvalsh((p + p.T) / 2).min() > 0


def test_batched_orthogonalization_equals_one_by_one() -> None:
    x = torch.randn(5, 64, 40)
    for backend in ("newton_schulz", "polar_express", "svd"):
        batched = orthogonalize(x, backend).float()
        single = torch.stack([orthogonalize(m, backend) for m in x]).float()
        torch.testing.assert_close(batched, single, atol=2e-3, rtol=0)


# ---------------------------------------------------------------- hand-written fp64 reference


def _reference_update(p, g, buf, *, lr, m, nesterov=True, wd=0.0, cautious=False, scale="ratio", parts=1):
    """One Muon step written out by hand with exact SVD, block by block (in place on p and buf)."""
    buf.mul_(m).add_(g, alpha=1 - m)
    d = g * (1 - m) + buf * m if nesterov else buf.clone()
    blocks = d.reshape(-1, *d.shape[-2:]) if p.ndim > 2 else d.reshape(parts, -1, d.shape[-1])
    updates = []
    for blk in blocks:
        u_, _, vh = torch.linalg.svd(blk, full_matrices=False)
        o = u_ @ vh
        r, c = o.shape
        factor = {
            "ratio": math.sqrt(max(1, r / c)),
            "max_dim": math.sqrt(max(r, c)),
            "rms": math.sqrt(r * c) / o.norm().item(),
            "none": 1.0,
        }[scale]
        updates.append(o * factor)
    upd = torch.stack(updates).reshape(p.shape)
    if cautious:
        p.sub_(p * ((upd * p) > 0), alpha=lr * wd)
    else:
        p.mul_(1 - lr * wd)
    p.sub_(upd, alpha=lr)


def _run_pair(shapes, steps, *, splits=None, schedule=None, **opts):
    """Run Muon (svd backend, fp64) and the reference on the same gradients; return both param lists."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    for i, parts in (splits or {}).items():
        set_muon_split(params[i], parts)
    ref = [t.clone() for t in init]
    bufs = [torch.zeros_like(t) for t in init]
    opt = Muon(params, backend="svd", **opts)
    lr, m = opts.get("lr", 0.02), opts.get("momentum", 0.95)
    for step in range(steps):
        if schedule:
            lr, m = schedule(step)
            opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"] = lr, m
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.grad = g.clone()
            _reference_update(
                ref[i],
                g,
                bufs[i],
                lr=lr,
                m=m,
                nesterov=opts.get("nesterov", True),
                wd=opts.get("weight_decay", 0.0),
                cautious=opts.get("cautious_weight_decay", False),
                scale=opts.get("shape_scale", "ratio"),
                parts=(splits or {}).get(i, 1),
            )
        opt.step()
    return [p.detach() for p in params], ref


def _assert_match(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("scale", SHAPE_SCALES)
def test_each_shape_scale_matches_reference(scale: str) -> None:
    _assert_match(*_run_pair([(48, 16), (16, 40), (24, 24)], 3, shape_scale=scale))


def test_rms_scale_gives_unit_rms_update() -> None:
    p = torch.nn.Parameter(torch.zeros(48, 16, dtype=torch.float64))
    p.grad = torch.randn(48, 16, dtype=torch.float64)
    Muon([p], lr=1.0, shape_scale="rms", backend="svd").step()
    assert p.detach().pow(2).mean().sqrt().item() == pytest.approx(1.0, abs=1e-12)


def test_momentum_and_lr_changes_per_step_take_effect() -> None:
    schedule = lambda step: (0.02 * (1 - step / 6), 0.85 + 0.1 * min(1.0, step / 3))
    _assert_match(*_run_pair([(32, 16), (16, 16)], 5, schedule=schedule))
    # ...and a run that ignored the schedule would differ.
    ignored, _ = _run_pair([(32, 16), (16, 16)], 5)
    scheduled, _ = _run_pair([(32, 16), (16, 16)], 5, schedule=schedule)
    assert not torch.allclose(ignored[0], scheduled[0])


def test_lr_scheduler_drives_the_step_size() -> None:
    p = torch.nn.Parameter(torch.zeros(16, 16, dtype=torch.float64))
    opt = Muon([p], lr=0.1, momentum=0.0, backend="svd", shape_scale="none")
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    sizes = []
    for _ in range(3):
        before = p.detach().clone()
        p.grad = torch.randn(16, 16, dtype=torch.float64)
        opt.step()
        scheduler.step()
        sizes.append((p.detach() - before).norm().item() / 4)  # an orthogonal 16×16 U has ‖U‖_F = 4
    assert sizes == pytest.approx([0.1, 0.05, 0.025], rel=1e-10)


def test_plain_momentum_without_nesterov_matches_reference() -> None:
    _assert_match(*_run_pair([(32, 16)], 3, nesterov=False))


@pytest.mark.parametrize("cautious", [False, True])
def test_weight_decay_matches_reference(cautious: bool) -> None:
    got, want = _run_pair([(32, 16), (16, 40)], 3, lr=0.1, weight_decay=0.5, cautious_weight_decay=cautious)
    _assert_match(got, want)
    plain, _ = _run_pair([(32, 16), (16, 40)], 3, lr=0.1, weight_decay=0.5)
    if cautious:
        assert not torch.allclose(got[0], plain[0])


def test_split_and_stacked_params_are_orthogonalized_per_block() -> None:
    _assert_match(*_run_pair([(48, 16), (3, 8, 24)], 2, splits={0: 3}, shape_scale="none"))
    qkv = set_muon_split(torch.nn.Parameter(torch.zeros(48, 16, dtype=torch.float64)), 3)
    bank = torch.nn.Parameter(torch.zeros(2, 3, 8, 24, dtype=torch.float64))
    for t in (qkv, bank):
        t.grad = torch.randn(t.shape, dtype=torch.float64)
    Muon([qkv, bank], lr=1.0, backend="svd", shape_scale="none").step()
    for block in [*qkv.detach().view(3, 16, 16), *bank.detach().view(-1, 8, 24)]:
        small = min(block.shape)
        gram = block @ block.T if block.shape[0] == small else block.T @ block
        torch.testing.assert_close(gram, torch.eye(small, dtype=torch.float64), atol=1e-10, rtol=0)
    # orthogonalizing the fused (48, 16) matrix whole would give columns of norm 1 across all 48 rows
    assert qkv.detach().norm(dim=0).sub(math.sqrt(3)).abs().max() < 1e-10


# ---------------------------------------------------------------- against torch.optim.Muon


# Muon's default iterations are the host's (ns_dtype None: bf16 where the CPU runs it fast, AMX and
# AVX512-BF16; fp32 on AVX2): the tests below give the precision and state what each one expects.
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_optim_muon(weight_decay: float, ns_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    shapes = [(64, 32), (32, 96), (48, 48), (64, 32)]
    mine = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    lr = 0.02
    opt = Muon(
        mine, lr=lr, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=weight_decay, ns_dtype=ns_dtype
    )
    ref = torch.optim.Muon(
        theirs,
        lr=lr,
        momentum=0.95,
        nesterov=True,
        weight_decay=weight_decay,
        ns_coefficients=(3.4445, -4.7750, 2.0315),
        ns_steps=5,
        eps=1e-7,
        adjust_lr_fn="original",
    )
    steps = 6
    for _ in range(steps):
        for a, b in zip(mine, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(mine, theirs, strict=True):
        # torch's iterations are bf16: ~1% of one step's size per step, whichever precision ours iterate in
        torch.testing.assert_close(a.detach(), b.detach(), atol=0.01 * lr * steps, rtol=0)


# ---------------------------------------------------------------- batching, state, errors


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batched_optimizer_equals_one_optimizer_per_param(ns_dtype: torch.dtype) -> None:
    torch.manual_seed(0)  # bf16 rounding of batched vs single matmuls can differ for rare inputs
    shapes = [(40, 24)] * 3 + [(24, 40)] * 2
    together = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    apart = [torch.nn.Parameter(p.detach().clone()) for p in together]
    opt = Muon(together, backend="polar_express", ns_dtype=ns_dtype)
    singles = [Muon([p], backend="polar_express", ns_dtype=ns_dtype) for p in apart]
    for _ in range(3):
        for a, b in zip(together, apart, strict=True):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        opt.step()
        for o in singles:
            o.step()
    for a, b in zip(together, apart, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), atol=1e-5, rtol=0)


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def test_state_dict_round_trip_continues_identically() -> None:
    make = lambda: [
        torch.nn.Parameter(torch.ones(32, 16)),
        torch.nn.Parameter(torch.ones(2, 16, 16, dtype=torch.bfloat16)),
    ]
    straight, resumed = make(), make()
    opt = Muon(straight, weight_decay=0.1)
    first = Muon(resumed, weight_decay=0.1)
    for step in range(3):
        _grads(straight, step), _grads(resumed, step)
        opt.step(), first.step()
    saved = first.state_dict()
    second = Muon(resumed, weight_decay=0.1)
    second.load_state_dict(saved)
    assert second.state[resumed[1]]["momentum_buffer"].dtype == torch.float32  # not cast to bf16
    for step in range(3, 6):
        _grads(straight, step), _grads(resumed, step)
        opt.step(), second.step()
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)


def test_rejects_vectors_and_scalars_with_their_name_or_index() -> None:
    with pytest.raises(ValueError, match=r"parameter 1 of param group 0 of shape \(16,\)"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(16))])
    with pytest.raises(ValueError, match=r"'ln.scale' of shape \(\)"):
        Muon(
            [("w", torch.nn.Parameter(torch.zeros(4, 4))), ("ln.scale", torch.nn.Parameter(torch.zeros(())))]
        )
    with pytest.raises(ValueError, match="unknown backend 'qr'"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], backend="qr")
    with pytest.raises(ValueError, match="unknown shape_scale"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], shape_scale="fro")
    with pytest.raises(ValueError, match=r"into 5 parts"):
        set_muon_split(torch.nn.Parameter(torch.zeros(12, 4)), 5)


def test_named_params_are_accepted() -> None:
    model = torch.nn.Linear(8, 16, bias=False)
    opt = Muon(model.named_parameters(), lr=0.1)
    model.weight.grad = torch.randn(16, 8)
    before = model.weight.detach().clone()
    opt.step()
    assert opt.param_groups[0]["param_names"] == ["weight"]
    assert not torch.equal(before, model.weight)
