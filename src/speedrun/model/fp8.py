"""FP8 matmul for the lm_head (2025-01-16 Sub3Min): e4m3 activations and weights in the forward,
e5m2 gradients in the backward, all through `torch._scaled_mm` (CUDA, and CPU in torch >= 2.13).

Scales as the record: the bf16 input is multiplied by `x_s` = 2 and the weight by `w_s` = 32 before
the cast to e4m3, so the values use the format's range; `_scaled_mm` divides them out again. The
gradient of the logits is multiplied by `grad_s` = 2^29 before its e5m2 cast (the per-token
gradients of a mean loss over 65,536 tokens are tiny). The record's 2^29 assumes the loss is a mean over its
65,536-token micro-batch; we scale it by tokens/65,536, so the record's size gets exactly 2^29 and a
small micro-batch does not overflow e5m2 (max 57,344) into inf. The forward returns bf16 logits; the
backward returns the input gradient in bf16 and the weight gradient in fp32, as the record's op does.
The op is a `torch.library` custom op, so `torch.compile(fullgraph=True)` traces through it.
"""

from __future__ import annotations

import torch
from torch import Tensor

X_SCALE, W_SCALE, GRAD_SCALE, RECORD_TOKENS = 2.0, 32.0, 2.0**29, 65536

#: Use `torch._scaled_mm` on CPU too (exact but ~0.5 s per call in torch 2.13); otherwise the CPU
#: computes the same thing from the fp8 values in fp32 (products of fp8 numbers are exact in fp32).
SCALED_MM_ON_CPU = False


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


@torch.library.custom_op("speedrun::fp8_mm", mutates_args=())
def fp8_mm(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """x (N, d) @ w (V, d)ᵀ in FP8; returns (bf16 output, x in e4m3, w in e4m3) for the backward."""
    x_f8 = x.mul(x_s).to(torch.float8_e4m3fn)
    w_f8 = w.mul(w_s).to(torch.float8_e4m3fn)
    inv = lambda s: x.new_tensor(1 / s, dtype=torch.float32)  # noqa: E731
    out = scaled_mm(x_f8, w_f8.t(), inv(x_s), inv(w_s), torch.bfloat16, fast=True)
    return out, x_f8, w_f8


@fp8_mm.register_fake
def _(x: Tensor, w: Tensor, *_: float) -> tuple[Tensor, Tensor, Tensor]:
    out = x.new_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    return out, x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)


@torch.library.custom_op("speedrun::fp8_mm_backward", mutates_args=())
def fp8_mm_backward(
    grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float, grad_s: float
) -> tuple[Tensor, Tensor]:
    """Gradients of fp8_mm: (input gradient in bf16, weight gradient in fp32)."""
    grad_f8 = grad.contiguous().mul(grad_s).to(torch.float8_e5m2)
    inv = lambda s: grad.new_tensor(1 / s, dtype=torch.float32)  # noqa: E731
    grad_x = scaled_mm(grad_f8, w_f8.t().contiguous().t(), inv(grad_s), inv(w_s), torch.bfloat16, fast=False)
    grad_w = scaled_mm(
        x_f8.t().contiguous(), grad_f8.t().contiguous().t(), inv(x_s), inv(grad_s), torch.float32, fast=False
    ).t()
    return grad_x, grad_w


@fp8_mm_backward.register_fake
def _(grad: Tensor, x_f8: Tensor, w_f8: Tensor, *_: float) -> tuple[Tensor, Tensor]:
    return x_f8.to(torch.bfloat16), w_f8.to(torch.float32)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    *_, x_s, w_s, grad_s = inputs
    _, x_f8, w_f8 = output
    ctx.save_for_backward(x_f8, w_f8)
    ctx.scales = x_s, w_s, grad_s
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
    x_f8, w_f8 = ctx.saved_tensors
    grad_x, grad_w = fp8_mm_backward(grad_out, x_f8, w_f8, *ctx.scales)
    return grad_x, grad_w, None, None, None


fp8_mm.register_autograd(_backward, setup_context=_setup_context)


def fp8_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., d) → bf16 (..., V) through the FP8 head matmul with the record's scales."""
    flat = x.reshape(-1, x.size(-1)).to(torch.bfloat16).contiguous()
    grad_scale = GRAD_SCALE * flat.size(0) / RECORD_TOKENS
    out = fp8_mm(flat, weight.contiguous(), X_SCALE, W_SCALE, grad_scale)[0]
    return out.reshape(*x.shape[:-1], -1)
