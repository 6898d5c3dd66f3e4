"""The FP8 head on the path CUDA takes: compiled by inductor (which checks every custom op's output
strides against its fake kernel), checked by torch.library.opcheck, and with each op body compiled
so that the scale-and-cast of the logit gradient is one pass."""

from __future__ import annotations

import re

import torch
from torch._inductor.utils import run_and_get_code

from speedrun.model import fp8

N, D, V = 64, 32, 48


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=gen).bfloat16()
    w = torch.randn(V, D, generator=gen) * 0.05
    grad = (torch.randn(N, V, generator=gen) * 1e-4).bfloat16()
    return x, w, grad


def _head_grads(fn, x, w, grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x, w)
    out.backward(grad)
    return out, x.grad, w.grad


def test_fp8_head_compiles_with_inductor_fullgraph_forward_and_backward():
    """Before the fake kernels returned the real strides this failed at the first backward with
    inductor's `expected size 48==48, stride 1==32` (assert_size_stride on fp8_mm_backward). Inductor's
    caches are off: their keys do not cover a custom op's fake kernel, so a stale entry could hide it."""
    torch._dynamo.reset()
    x, w, grad = _inputs()
    compiled = torch.compile(fp8.fp8_linear, backend="inductor", fullgraph=True, dynamic=False)
    # the configs' own patch() restores them (monkeypatch's undo can delete a config entry: a later
    # compile in the same process then failed with "enable_autograd_cache does not exist")
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        got = _head_grads(compiled, x, w, grad)
    want = _head_grads(fp8.fp8_linear, x, w, grad)  # eager: the same op bodies, so the same bits
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_fp8_ops_pass_opcheck():
    """Fake kernels (shapes, dtypes and strides) and autograd registration vs the real ops, and the
    backward op under AOT dispatch. Two of opcheck's checks cannot run on fp8 *outputs* on CPU (their
    comparison ops lack fp8 kernels: `mul_cpu_reduced_float`, `sum_cpu`): for fp8_mm, the inductor test
    above covers AOT dispatch and the no-mutation rule is checked here directly."""
    x, w, grad = _inputs()
    scales = (fp8.X_SCALE, fp8.W_SCALE, fp8.GRAD_SCALE * N / fp8.RECORD_TOKENS)
    forward_checks = ("test_autograd_registration", "test_faketensor")
    args = (x.requires_grad_(), w.requires_grad_(), *scales)
    torch.library.opcheck(fp8.fp8_mm, args, test_utils=forward_checks)
    _, x_f8, w_f8 = fp8.fp8_mm(x.detach(), w.detach(), *scales)
    bits = lambda: [t.clone() for t in (x, w, grad, x_f8.view(torch.uint8), w_f8.view(torch.uint8))]  # noqa: E731
    before = bits()
    backward_checks = (*forward_checks, "test_aot_dispatch_dynamic")
    torch.library.opcheck(fp8.fp8_mm_backward, (grad, x_f8, w_f8, *scales), test_utils=backward_checks)
    assert all(torch.equal(a, b) for a, b in zip(before, bits(), strict=True))
    grad_w = fp8.fp8_mm_backward(grad, x_f8, w_f8, *scales)[1]
    assert grad_w.stride() == (1, V)  # the record's transposed layout, which the fake must declare


def test_compiled_backward_body_casts_the_logit_gradient_in_one_pass(monkeypatch):
    """Inductor's code for the backward body writes no scaled bf16 copy of the (N, V) gradient: the
    multiply by grad_s and the e5m2 cast are one kernel (eager writes both). Same values as eager."""
    torch._dynamo.reset()
    monkeypatch.setattr(fp8, "COMPILE_BODIES_ON_CPU", True)
    x, w, grad = _inputs(1)
    scales = (fp8.X_SCALE, fp8.W_SCALE, fp8.GRAD_SCALE * N / fp8.RECORD_TOKENS)
    _, x_f8, w_f8 = fp8.forward_body(x, w, *scales[:2])
    (grad_x, grad_w), codes = run_and_get_code(fp8._run, fp8.backward_body, grad, x_f8, w_f8, *scales)
    code = "\n".join(codes)
    buffers = re.findall(r"empty_strided_cpu\(\((\d+), (\d+)\), \((\d+), (\d+)\), torch\.(\w+)\)", code)
    assert buffers, "inductor's code format changed: no buffer allocation found"
    assert (str(N), str(V), "bfloat16") not in {(a, b, t) for a, b, _, _, t in buffers}
    want_x, want_w = fp8.backward_body(grad, x_f8, w_f8, *scales)
    torch.testing.assert_close(grad_x, want_x, rtol=0, atol=0)
    torch.testing.assert_close(grad_w, want_w, rtol=1e-6, atol=0)
    assert grad_w.stride() == want_w.stride() == (1, V)
