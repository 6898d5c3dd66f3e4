"""FP8 matmul for the lm_head (2025-01-16 Sub3Min): e4m3 activations and weights forward, e5m2
gradients backward, through `torch._scaled_mm` (CUDA, and CPU in torch >= 2.13).

Scales as the record: input × `x_s` = 2, weight × `w_s` = 32 before the e4m3 cast; the logits'
gradient × `grad_s` = 2^29 × tokens/65,536 before its e5m2 cast (the record's value at its micro-batch,
no e5m2 overflow at small ones). bf16 logits out; bf16 input and fp32 weight gradients, as the record.
Both ops are `torch.library` custom ops whose fake kernels return the real strides (inductor checks
them), and each body is compiled (on CUDA, or on CPU with `COMPILE_BODIES_ON_CPU`) so a scale-and-cast
is one pass."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

X_SCALE, W_SCALE, GRAD_SCALE, RECORD_TOKENS = 2.0, 32.0, 2.0**29, 65536

#: Use `torch._scaled_mm` on CPU too (exact but ~0.5 s per call in torch 2.13); otherwise the CPU
#: computes the same thing from the fp8 values in fp32 (products of fp8 numbers are exact in fp32).
SCALED_MM_ON_CPU = False
#: Compile the op bodies on CPU as CUDA does (tests of the fused cast; slow to compile on a small CPU).
COMPILE_BODIES_ON_CPU = False


def scaled_mm(
    a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype, fast: bool
) -> Tensor:
    """`torch._scaled_mm` (fp8 a @ fp8 b, times both scales, in out_dtype) on CUDA; on CPU an fp32
    evaluation of the same fp8 operands unless SCALED_MM_ON_CPU."""
    if a.is_cuda or SCALED_MM_ON_CPU:
        return torch._scaled_mm(
            a, b, out_dtype=out_dtype, scale_a=scale_a, scale_b=scale_b, use_fast_accum=fast
        )
    return ((a.float() @ b.float()) * (scale_a * scale_b)).to(out_dtype)


def _inverse(t: Tensor, s: float) -> Tensor:
    return t.new_tensor(1 / s, dtype=torch.float32)


def forward_body(x: Tensor, w: Tensor, x_s: float, w_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """x (N, d) @ w (V, d)ᵀ: (bf16 output, x in e4m3, w in e4m3)."""
    x_f8 = x.mul(x_s).to(torch.float8_e4m3fn)
    w_f8 = w.mul(w_s).to(torch.float8_e4m3fn)
    out = scaled_mm(x_f8, w_f8.t(), _inverse(x, x_s), _inverse(x, w_s), torch.bfloat16, fast=True)
    return out, x_f8, w_f8


def backward_body(
    grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float, grad_s: float
) -> tuple[Tensor, Tensor]:
    """(input gradient (N, d) in bf16, weight gradient (V, d) in fp32 with strides (1, V)), as the
    record: the weight gradient is the transpose of x_f8ᵀ @ grad_f8, the faster order at (768, 50304)."""
    grad_f8 = grad.mul(grad_s).to(torch.float8_e5m2)
    inv_g = _inverse(grad, grad_s)
    grad_x = scaled_mm(grad_f8, w_f8.t().contiguous().t(), inv_g, _inverse(grad, w_s), torch.bfloat16, False)
    grad_w = scaled_mm(
        x_f8.t().contiguous(), grad_f8.t().contiguous().t(), _inverse(grad, x_s), inv_g, torch.float32, False
    ).t()
    return grad_x, grad_w


@functools.cache
def _compiled(body: Callable) -> Callable:
    return torch.compile(body, dynamic=False, fullgraph=True)


def _run(body: Callable, first: Tensor, *args: object) -> object:
    """The body compiled on CUDA (one fused scale-and-cast pass), eager on CPU unless asked."""
    fn = _compiled(body) if first.is_cuda or COMPILE_BODIES_ON_CPU else body
    return fn(first, *args)


@torch.library.custom_op("speedrun::fp8_mm", mutates_args=())
def fp8_mm(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """x (N, d) @ w (V, d)ᵀ in FP8; returns (bf16 output, x in e4m3, w in e4m3) for the backward."""
    return _run(forward_body, x.contiguous(), w.contiguous(), x_s, w_s)


@fp8_mm.register_fake
def _(x: Tensor, w: Tensor, *_: float) -> tuple[Tensor, Tensor, Tensor]:
    out = x.new_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    x_f8 = x.new_empty(x.shape, dtype=torch.float8_e4m3fn)
    return out, x_f8, w.new_empty(w.shape, dtype=torch.float8_e4m3fn)


@torch.library.custom_op("speedrun::fp8_mm_backward", mutates_args=())
def fp8_mm_backward(
    grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float, grad_s: float
) -> tuple[Tensor, Tensor]:
    """Gradients of fp8_mm: (input gradient in bf16, weight gradient in fp32, a transposed view)."""
    return _run(backward_body, grad.contiguous(), x_f8, w_f8, x_s, w_s, grad_s)


@fp8_mm_backward.register_fake
def _(grad: Tensor, x_f8: Tensor, w_f8: Tensor, *_: float) -> tuple[Tensor, Tensor]:
    grad_x = grad.new_empty(grad.shape[0], x_f8.shape[1], dtype=torch.bfloat16)
    V, d = w_f8.shape
    return grad_x, grad.new_empty_strided((V, d), (1, V), dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    *_, x_s, w_s, grad_s = inputs
    _, x_f8, w_f8 = output
    ctx.save_for_backward(x_f8, w_f8)
    ctx.mark_non_differentiable(x_f8, w_f8)  # saved for the backward, not outputs of the math
    ctx.scales = x_s, w_s, grad_s
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
    x_f8, w_f8 = ctx.saved_tensors
    grad_x, grad_w = fp8_mm_backward(grad_out, x_f8, w_f8, *ctx.scales)
    return grad_x, grad_w, None, None, None


fp8_mm.register_autograd(_backward, setup_context=_setup_context)


def head_logits(head: torch.nn.Linear, x: Tensor, fp8: bool) -> Tensor:
    """The head's matmul: with `fp8` the FP8 one in training with gradients (Sub3Min), else the plain one."""
    return fp8_linear(x, head.weight) if fp8 and head.training and torch.is_grad_enabled() else head(x)


def fp8_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., d) → bf16 (..., V) through the FP8 head matmul with the record's scales."""
    flat = x.reshape(-1, x.size(-1)).to(torch.bfloat16).contiguous()
    grad_scale = GRAD_SCALE * flat.size(0) / RECORD_TOKENS
    out = fp8_mm(flat, weight.contiguous(), X_SCALE, W_SCALE, grad_scale)[0]
    return out.reshape(*x.shape[:-1], -1)
