"""The speed layer's Triton kernels compiled on CUDA at the record's shapes, against their plain twins
(issue 44; the same kernels run through Triton's interpreter in tests/unit/test_perf_kernels.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests import perf_interpreted as cases

pytest.importorskip("triton")
ortho = importlib.import_module("speedrun.optim.orthogonalize")
head = importlib.import_module("speedrun.model.gpt2026.head")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_the_compiled_gram_kernels_equal_their_twins_on_cuda():
    from speedrun.perf.kernels import gram

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 768, 3072, device="cuda", generator=g).bfloat16() / 3072**0.5
    got, want = gram.gram(x), ortho.gram.plain(x)
    assert torch.equal(got, got.mT)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    got, want = (
        gram.ba_plus_caa(want, cases.NS_B, cases.NS_C),
        ortho.ba_plus_caa.plain(want, cases.NS_B, cases.NS_C),
    )
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)


def assert_loss_and_gradient_equal(kernel, twin, logits, args, loss_atol, grad_atol):
    """A CE kernel on bf16 logits against its plain twin on the same logits in fp32: the loss to rtol 1e-5,
    the logits' gradient to one bf16 step."""
    x = logits.clone().requires_grad_()
    got = kernel(x, *args)
    got.backward()
    y = logits.float().requires_grad_()
    want = twin(y, *args)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=loss_atol)
    torch.testing.assert_close(x.grad.float(), y.grad, rtol=2**-7, atol=grad_atol)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mtp", [None, (1.0, 0.5, 0.25)])
@pytest.mark.parametrize("arm", ["plain", "prefix"])
def test_the_compiled_softcapped_ce_and_its_prefix_arm_equal_their_twins_on_cuda(arm, mtp):
    from speedrun.perf.kernels import softcapped_ce

    g = torch.Generator(device="cuda").manual_seed(0)
    raw = (torch.randn(2, 2048, 50304, device="cuda", generator=g) * 8).bfloat16()
    targets = torch.randint(0, 50257, (2, 2048), device="cuda", generator=g)
    weights = None if mtp is None else torch.tensor(mtp, device="cuda")
    if arm == "plain":
        kernel, twin, extra = softcapped_ce.softcapped_ce, head.softcapped_ce.plain, ()
    else:  # #88's prefix term: a table of prefix targets (−1: none) and its weight
        table = torch.randint(-1, 50257, (50304,), device="cuda", generator=g)
        kernel, twin = softcapped_ce.softcapped_prefix_ce, head.softcapped_prefix_ce.plain
        extra = (table, torch.tensor(0.25, device="cuda"))
    args = (targets, weights, *extra, 11.5, 7.5, 5.0, False, False)
    assert_loss_and_gradient_equal(kernel, twin, raw, args, loss_atol=1e-5, grad_atol=1e-9)


@pytest.mark.gpu
@cuda
def test_the_compiled_relu2_linear_equals_its_twin_on_cuda():
    from speedrun.model.layers import relu2_linear as twin
    from speedrun.perf.kernels import relu2_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 768, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(3072, 768, device="cuda", generator=g) / 768**0.5).bfloat16().requires_grad_()
    got = relu2_linear.relu2_linear(x, w)
    got.float().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want = twin.plain(x, w)
    want.float().sum().backward()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx, x.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw, w.grad, rtol=2e-2, atol=5e-1)


@pytest.mark.gpu
@cuda
def test_the_compiled_sampled_arm_equals_its_twin_on_cuda():
    from speedrun.model.gpt2026 import sampled
    from speedrun.perf.kernels import softcapped_ce

    g = torch.Generator(device="cuda").manual_seed(0)
    P = 16384  # #92's candidate counts are multiples of 2048
    logits = (torch.randn(1, 8192, P, device="cuda", generator=g) * 8).bfloat16()
    pos = torch.randint(0, P, (1, 8192), device="cuda", generator=g)
    prefix_pos = torch.randint(-P // 4, P, (1, 8192), device="cuda", generator=g).clamp(min=-1)
    args = (pos, torch.tensor([1.0, 0.5], device="cuda"), prefix_pos, torch.tensor(0.25, device="cuda"))
    kernel, twin = softcapped_ce.sampled_softcapped_ce, sampled.sampled_softcapped_ce.plain
    assert_loss_and_gradient_equal(
        kernel, twin, logits, (*args, 11.5, 7.5, 5.0), loss_atol=1e-3, grad_atol=1e-6
    )


@pytest.mark.gpu
@cuda
def test_the_compiled_ngram_gather_and_sink_equal_their_twin_on_cuda():
    from speedrun.model.gpt2026.ngram import ngram_embed as twin
    from speedrun.model.gpt2026.ngram import ngram_rows, ngram_signs
    from speedrun.perf.kernels import ngram_embed

    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, 50257, (1, 8192), device="cuda", generator=g)
    rows = 1 << 16  # a small table: rows repeat across the 16,384 reads
    slots, (sb, st) = ngram_rows(idx, rows), ngram_signs(idx, 256)
    table = (torch.randn(rows, 768, device="cuda", generator=g) * 0.1).bfloat16()
    pool = torch.randn(256, 768, device="cuda", generator=g).sign().bfloat16()
    w = torch.randn(1, 8192, 768, device="cuda", generator=g)
    x, y = table.clone().requires_grad_(), table.float().requires_grad_()
    got = ngram_embed.ngram_embed(x, slots, sb, st, pool)
    (got.float() * w).sum().backward()
    want = twin.plain(y, slots, sb, st, pool)  # in fp32: the kernel's sums, one rounding at the end
    (want * w.bfloat16().float()).sum().backward()
    assert torch.equal(got, want.bfloat16())
    torch.testing.assert_close(x.grad.float(), y.grad, rtol=2**-7, atol=1e-6)


@pytest.mark.gpu
@cuda
def test_the_row_adam_kernel_equals_its_twin_on_cuda():
    from speedrun import ops
    from speedrun.optim.row_adam import RowAdam
    from speedrun.perf.kernels import row_adam

    g = torch.Generator(device="cuda").manual_seed(0)
    start = (torch.randn(1 << 18, 768, device="cuda", generator=g) * 0.1).bfloat16()
    steps = []
    for s in range(1, 9):  # 16,384 reads of 2^18 rows a step (repeats), β2 squared from step 5
        rows = torch.randint(0, 1 << 18 if s % 3 else 1 << 12, (16384,), device="cuda", generator=g)
        steps.append(
            (rows, torch.randn(16384, 768, device="cuda", generator=g), 0.05, 0.95 if s < 5 else 0.95**2, 0.7)
        )
    out = []
    for fn in (row_adam.row_adam_rows, None):
        if fn is not None:
            ops.install("row_adam_rows", fn)
        table = start.clone()
        opt = RowAdam(table)
        for args in steps:
            opt.step(*args)
        opt.bring_current()
        ops.reset()
        out.append((table.float(), opt.exp_avg_sq))
    (got, got_v), (want, want_v) = out
    torch.testing.assert_close(got_v, want_v, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(got, want, rtol=0, atol=2**-6 * want.abs().max().item())
