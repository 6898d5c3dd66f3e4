"""#344's packed FP8 Q/K/V projection (model/gpt2026/fp8_qkv.py) against the record's formula written
here in fp64 with a brute-force e4m3 rounding (a table of the 127 finite magnitudes, nearest, ties to the
even code), independent of torch's float8 cast: the weight refresh, the forward, the gradients of the
input, the fused weight and λ0; the twin at evaluation; the mean loss's gradient scale; the compiled path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speedrun.model import fp8
from speedrun.model.gpt2026.fp8_qkv import Fp8QKV, PlainQKV, weight_fp8
from tests.conftest import inductor_cpu_codegen

H, DQK, C, N = 2, 12, 32, 48  # #344's shape in small: Q/K narrower than V (C / H = 16)
ROWS = 2 * H * DQK + C


def e4m3_table() -> torch.Tensor:
    """Every finite e4m3fn magnitude by code (exponent bias 7, 3 mantissa bits; code 0x7f is NaN)."""
    values = [
        (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7) for e in range(16) for m in range(8)
    ]
    return torch.tensor(values[:-1], dtype=torch.float64)


TABLE = e4m3_table()


def round_e4m3(t: torch.Tensor) -> torch.Tensor:
    """fp64 values (|t| ≤ 448) to the nearest e4m3 value, ties to the even code."""
    a = t.double().abs().flatten()
    hi = torch.searchsorted(TABLE, a).clamp(max=len(TABLE) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - TABLE[lo], TABLE[hi] - a
    pick = torch.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi)
    return (torch.sign(t.double()).flatten() * TABLE[pick]).view(t.shape)


def quant(t: torch.Tensor, scale: float) -> torch.Tensor:
    """The record's cast: t / scale (fp32 division), saturated at ±448, in e4m3 (as fp64 values)."""
    scaled = t.float() / torch.tensor(scale, dtype=torch.float32)
    return round_e4m3(scaled.double().clamp(-448, 448))


def record_packed_qkv(x, weight, lam, grad=None, tokens=N):
    """PackedFP8QKVFunction (c4c209d1 triton_kernels.py 2438-2540) with the refresh's scale, in fp64:
    (output, dX, ∂W, ∂λ0), or the output alone without `grad`. `tokens`: the mean loss's count (the
    record's gradient scale is per token of its summed loss)."""
    amax = weight.float().abs().amax()
    w_s = float(amax * torch.tensor(1 / 448, dtype=torch.float32))  # tl.maximum(amax, 1e-12) * (1.0 / 448)
    x_s = float(torch.tensor(8 / 448, dtype=torch.float32))
    g_s = float(torch.tensor(1 / 448, dtype=torch.float32) / tokens)
    xq, wq = quant(x, x_s), quant(weight, w_s)
    out = (xq @ wq.T) * x_s * (w_s * float(lam))
    if grad is None:
        return out
    gq = quant(grad, g_s)
    grad_w = (gq.T @ xq) * g_s * x_s
    grad_x = (gq @ wq) * g_s * (w_s * float(lam))
    return out, grad_x, grad_w * float(lam), (grad_w * weight.double()).sum()


def _module(seed: int = 0) -> Fp8QKV:
    torch.manual_seed(seed)
    m = Fp8QKV(C, ROWS).train()
    with torch.no_grad():
        m.weight.uniform_(-0.1, 0.1)
    m.refresh_fp8(-1)
    return m


def _inputs(seed: int = 1, scale_x: float = 3.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, N, C, generator=gen) * scale_x  # some |x| > 8: saturated, as the record's cast
    grad = torch.randn(1, N, ROWS, generator=gen) * (0.5 / N)  # a mean loss's; some codes saturate too
    return x, grad


@pytest.fixture(params=[False, True], ids=["fp32-twin", "scaled_mm"])
def cpu_mm(request, monkeypatch):
    """Both CPU paths: the fp32 evaluation of the fp8 operands and torch._scaled_mm itself (which checks
    the operand layouts CUDA's needs: row-major first, column-major second)."""
    monkeypatch.setattr(fp8, "SCALED_MM_ON_CPU", request.param)


def test_refresh_writes_the_records_dual_layout_e4m3_weight():
    m = _module()
    amax = m.weight.detach().abs().amax()
    assert m.w_scale.item() == (amax * torch.tensor(1 / 448)).item()
    want = quant(m.weight.detach(), m.w_scale.item())
    assert torch.equal(m.w_f8.double(), want)
    assert torch.equal(m.w_f8_t.view(torch.uint8), m.w_f8.view(torch.uint8).t())
    assert m.w_f8_t.is_contiguous() and m.w_f8.dtype == m.w_f8_t.dtype == torch.float8_e4m3fn
    assert m.state_dict().keys() == {"weight"}  # the copies are not checkpointed: the refresh rebuilds them


@pytest.mark.parametrize("lam", [None, 0.7])
def test_forward_and_gradients_are_the_records_formula(cpu_mm, lam):
    m = _module()
    x, grad = _inputs()
    lam_t = None if lam is None else torch.tensor(lam, requires_grad=True)
    x.requires_grad_(True)
    out = m.project(x, lam_t)
    out.backward(grad)
    ref_out, ref_dx, ref_dw, ref_dlam = record_packed_qkv(
        x[0].detach(), m.weight.detach(), lam or 1.0, grad[0], N
    )
    assert out.dtype == torch.float32 and out.shape == (1, N, ROWS)
    # fp32 sums of exact fp8 products: a few fp32 ulps of the sums' magnitude
    for got, want in ((out[0], ref_out), (x.grad[0], ref_dx), (m.weight.grad, ref_dw)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    if lam is not None:
        torch.testing.assert_close(lam_t.grad.double(), ref_dlam, rtol=1e-5, atol=1e-9)


def test_under_autocast_the_output_has_the_twins_dtype_and_the_formulas_value():
    """As F.linear under autocast: bf16 out; the fp8 products themselves are not autocast to bf16."""
    m = _module()
    x, _ = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, twin = m.project(x), PlainQKV.project(m, x)
    assert out.dtype == twin.dtype == torch.bfloat16
    want = record_packed_qkv(x[0], m.weight.detach(), 1.0)
    # within one bf16 ulp: the fp32 sums come from the CPU's matmul kernel, whose summation order (AVX2,
    # AVX-512, AMX) may move a value across a bf16 rounding boundary; a wrong formula misses by far more
    torch.testing.assert_close(out[0].double(), want.to(torch.bfloat16).double(), rtol=2**-7, atol=0)


def test_forward_reads_the_refreshed_copy_not_the_live_weight():
    """Once per optimizer step: a weight change shows only after the refresh."""
    m = _module()
    x, _ = _inputs()
    before = m.project(x).detach()
    with torch.no_grad():
        m.weight.mul_(1.5)
    torch.testing.assert_close(m.project(x).detach(), before, rtol=0, atol=0)
    m.refresh_fp8(0)
    after = m.project(x).detach()
    assert not torch.equal(after, before)
    want = record_packed_qkv(x[0], m.weight.detach(), 1.0)
    torch.testing.assert_close(after[0].double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_is_its_plain_twin_within_fp8_error_and_the_twin_at_evaluation():
    m = _module()
    twin = PlainQKV(C, ROWS)
    twin.load_state_dict(m.state_dict())
    x, grad = _inputs(scale_x=1.0)
    grad = grad / 5  # no gradient code saturates here (the formula test covers saturation)
    lam, lam_twin = torch.tensor(0.7, requires_grad=True), torch.tensor(0.7, requires_grad=True)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, ref = m.project(xa, lam), twin.project(xb, lam_twin)
    out.backward(grad), ref.backward(grad)
    for got, want in ((out, ref), (xa.grad, xb.grad), (m.weight.grad, twin.weight.grad)):
        err = ((got - want).norm() / want.norm()).item()
        assert 1e-4 < err < 0.06, err  # e4m3 has 3 mantissa bits: a few percent, but not exact
    terms = (twin.weight.grad / 0.7 * twin.weight.detach()).abs().sum()  # ∂λ0 = Σ dW ⊙ W cancels: per term
    assert 0 < (lam.grad - lam_twin.grad).abs() / terms < 0.06
    m.eval()
    torch.testing.assert_close(m.project(x, lam), F.linear(x, (lam * m.weight).type_as(x)), rtol=0, atol=0)
    m.train()
    with torch.no_grad():
        torch.testing.assert_close(m.project(x), twin.project(x), rtol=0, atol=0)


def test_the_mean_losss_gradient_scale_keeps_the_codes_of_the_records_summed_loss():
    """The record's fixed 1/448 is per token of a summed loss; the package's micro-batch mean divides each
    token's gradient by the token count. With the count in the scale, a token's e4m3 gradient codes do not
    depend on the micro-batch size (a fixed 1/448 leaves a 3,072-token mean's gradients a few subnormal
    codes: this test and the formula's fail with it)."""
    m = _module()
    x, _ = _inputs(scale_x=1.0)
    per_token = torch.randn(1, N, ROWS, generator=torch.Generator().manual_seed(3)) * 0.1
    grads_x = []
    for copies in (1, 64):  # 48 and 3,072 tokens, the same rows repeated
        xs = x.repeat(1, copies, 1).requires_grad_(True)
        tokens = N * copies
        m.project(xs).backward(per_token.repeat(1, copies, 1) / tokens)
        grads_x.append(xs.grad[:, :N] * tokens)
    torch.testing.assert_close(grads_x[1], grads_x[0], rtol=1e-6, atol=0)
    twin = per_token[0] @ m.weight.detach()
    assert ((grads_x[0][0] - twin).norm() / twin.norm()).item() < 0.08


def test_compiled_with_inductor_as_cuda_compiles_it_is_eager():
    """fullgraph, static shapes: the same fp8 casts and products, forward and backward."""
    torch._dynamo.reset()
    m = _module()
    x, grad = _inputs()
    lam = torch.tensor(0.7, requires_grad=True)

    def step(x, lam):
        return m.project(x, lam)

    runs = []
    for fn in (step, torch.compile(step, backend="inductor", fullgraph=True, dynamic=False)):
        xs, lams = x.clone().requires_grad_(True), lam.detach().clone().requires_grad_(True)
        m.weight.grad = None
        with inductor_cpu_codegen():
            out = fn(xs, lams)
            out.backward(grad)
        runs.append((out.detach(), xs.grad, m.weight.grad, lams.grad))
    for got, want in zip(*runs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scaled_mm_path_is_the_records_formula_in_bf16():
    """The CUDA path (torch._scaled_mm, bf16 out, fast accumulation forward) against the fp64 formula."""
    m = _module().cuda()
    m.refresh_fp8(-1)
    x, grad = _inputs()
    xb = x.cuda().bfloat16().requires_grad_(True)
    lam = torch.tensor(0.7, device="cuda", requires_grad=True)
    out = m.project(xb, lam)
    assert out.dtype == torch.bfloat16
    out.backward(grad.cuda().bfloat16())
    ref = record_packed_qkv(xb[0].detach().cpu(), m.weight.detach().cpu(), 0.7, grad[0].bfloat16(), N)
    for got, want in ((out[0], ref[0]), (xb.grad[0], ref[1]), (m.weight.grad, ref[2])):
        torch.testing.assert_close(got.cpu().double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_a_model_with_fp8_qkv_trains_near_its_twin_refreshed_by_the_family_hook():
    """record-2026-07 shrunk, #344's narrower Q/K on: the family's after_step refreshes every layer's
    copies before each step; the losses stay within FP8 error of the plain model's and fall; the same
    checkpoint keys; evaluation is the twin's, bit for bit."""
    from speedrun.model.families import family_of
    from speedrun.train.schedule import apply_schedule, schedule_at
    from speedrun.train.step import train_step
    from tests.recipe_matrix import autocast_dtype, batch, build, rows, shrunk

    runs = []
    for on in ("false", "true"):
        cfg = shrunk(
            "record-2026-07", "model.attn.qk_head_dim=24", "model.mlp.fp8=false", f"model.attn.fp8_qkv={on}"
        )
        model, optimizer = build(cfg)
        after_step, losses = family_of(cfg.model).after_step, []
        for step in range(4):
            sched = schedule_at(step, cfg)
            apply_schedule(sched, optimizer, model)
            after_step(model, step - 1)
            x, y = batch(0, cfg)
            parts = iter(range(x.size(0)))

            def next_batch(x=x, y=y, parts=parts, cfg=cfg):
                i = next(parts)
                return rows(cfg, x[i : i + 1], y[i : i + 1])

            loss = train_step(
                model, optimizer, next_batch, x.size(0), autocast_dtype(cfg), 0.0, sched.grad_scale
            )
            losses.append(loss.item())
        runs.append((model, losses, cfg))
    (twin, twin_losses, cfg), (model, losses, _) = runs
    attns = [b.attn for b in model.blocks if b.attn is not None]
    assert attns and all(isinstance(a.c_attn, Fp8QKV) for a in attns)
    fresh = lambda a: torch.equal(
        a.c_attn.w_f8.view(torch.uint8), weight_fp8(a.c_attn.weight)[0].view(torch.uint8)
    )  # noqa: E731
    assert not any(fresh(a) for a in attns)  # the last optimizer step moved every weight
    family_of(cfg.model).after_step(model, 3)
    assert all(fresh(a) for a in attns)
    assert model.state_dict().keys() == twin.state_dict().keys()
    assert losses[-1] < losses[0] and losses[0] == pytest.approx(twin_losses[0], rel=0.02), (
        losses,
        twin_losses,
    )
    assert losses != twin_losses  # the FP8 products did run
    twin.load_state_dict(model.state_dict())
    model.eval(), twin.eval()
    x, y = batch(1, cfg)
    with torch.no_grad():
        torch.testing.assert_close(
            model(*rows(cfg, x[:1], y[:1])), twin(*rows(cfg, x[:1], y[:1])), rtol=0, atol=0
        )
