"""#344's packed FP8 Q/K/V projection (modded-nanogpt PR #344, 2026-08-03, `refs/pull/344/head` c4c209d1:
`PackedFP8QKVFunction` and `quantize_dual_layout_packed_batched` in triton_kernels.py, `quantize_attn_fp8`
and the `_attn_*_scales` buffers in train_gpt.py).

The fused weight (2·H·Dqk + C rows: Q, K, V; Dqk = 96 with #344's narrower Q/K) is one e4m3 matrix, stored
row-major and transposed so that neither matmul of the backward transposes it. Everything is e4m3, the
gradient too (no e5m2), each tensor with one scale:
- weight: refreshed after each optimizer step with its exact scale s_w = max(amax|W|, 1e-12)·(1/448);
- input (the normed attention input): a fixed s_x = 8/448 (|x| beyond 8 saturates);
- the output's gradient: a fixed 1/448 per token of the record's summed loss; the package back-propagates
  a micro-batch's mean, so here 1/448 / tokens, which gives the same e4m3 codes.
Every cast saturates at ±448, as the record's Triton casts do (written out: torch 2.13's CPU cast
saturates too, but a cast's overflow rule is the kernel's, and e4m3fn's overflow code is NaN).
Forward: qkv = (x_f8 · W_f8ᵀ)·s_x·(s_w·λ0) in the compute dtype, λ0 (#47/#48) applied as a scale, so the
cache holds W, not λ0·W. Backward: dW = (g_f8ᵀ · x_f8)·s_g·s_x, dX = (g_f8 · W_f8)·s_g·(s_w·λ0), in the
compute dtype, then ∂W = λ0·dW and ∂λ0 = Σ dW ⊙ W, as the record's function returns them. The record fuses
QK-norm, rotary, the key offset and FA3's padding into the same kernels; here autograd runs those parts
as the plain path does, and this op sees only the projection (its gradient arrives already rounded to the
compute dtype, as the record's kernel rounds it to bf16 before the cast).

Training forwards only; evaluation and `torch.no_grad` run the plain twin. The products go through
model/fp8.scaled_mm: `torch._scaled_mm` on CUDA (and on CPU with SCALED_MM_ON_CPU), else its exact fp32
evaluation of the same fp8 operands, so every CPU runs this path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from speedrun.model import fp8
from speedrun.model.gpt2026.fp8_mlp import E4M3_MAX
from speedrun.model.layers import CastedLinear

X_SCALE, GRAD_SCALE, WEIGHT_HEADROOM = 8.0 / 448.0, 1.0 / 448.0, 1.0  # _attn_x_scales, _attn_grad_scales


def saturate_e4m3(t: Tensor, scale: Tensor) -> Tensor:
    """t / scale in fp32, clamped to ±448, rounded to e4m3: the record's quantizer (one for all three)."""
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def weight_fp8(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The packed weight (rows, C) → (e4m3 row-major, e4m3 transposed (C, rows), scale (1,) fp32), with
    its exact amax, as the record's refresh after each optimizer step."""
    w = weight.detach().float()
    scale = (w.abs().amax().clamp(min=1e-12) * (WEIGHT_HEADROOM / E4M3_MAX)).reshape(1)
    row = saturate_e4m3(w, scale)
    return row, row.t().contiguous(), scale


class _PackedFp8(torch.autograd.Function):
    """x (…, C) → (…, rows) through the cached e4m3 weight; gradients of x, W and λ0 in FP8 products."""

    @staticmethod
    def forward(ctx, x, weight, lam, w_f8, w_f8_t, w_scale, dtype, grad_s):  # noqa: ANN001
        flat = x.reshape(-1, x.size(-1))
        x_s = w_scale.new_full((1,), X_SCALE)
        with torch.autocast(x.device.type, enabled=False):  # the fp32 twin of _scaled_mm stays fp32
            x_f8 = saturate_e4m3(flat, x_s)
            w_s = w_scale * lam
            out = fp8.scaled_mm(x_f8, w_f8.t(), x_s, w_s, dtype, True)
        ctx.save_for_backward(x_f8.t().contiguous(), w_f8_t, x_s, w_s, weight, lam)
        ctx.shape, ctx.grad_s = x.shape, grad_s
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        x_f8_t, w_f8_t, x_s, w_s, weight, lam = ctx.saved_tensors
        g = grad.reshape(-1, grad.size(-1))
        g_s = x_s.new_full((1,), ctx.grad_s)
        with torch.autocast(grad.device.type, enabled=False):
            g_f8 = saturate_e4m3(g, g_s)
            grad_w = fp8.scaled_mm(g_f8.t().contiguous(), x_f8_t.t(), g_s, x_s, grad.dtype, False)
            grad_x = fp8.scaled_mm(g_f8, w_f8_t.t(), g_s, w_s, grad.dtype, False)
        grad_lam = (grad_w * weight.to(grad_w.dtype)).sum() if ctx.needs_input_grad[2] else None
        return grad_x.view(ctx.shape), grad_w * lam, grad_lam, None, None, None, None, None


class PlainQKV(CastedLinear):
    """The fused QKV weight (2·H·Dqk + C, C) and its projection x · (λ0·W)ᵀ in x's dtype (λ0: #47/#48's
    weight scale, None where λ0 scales v after the projection)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def project(self, x: Tensor, lam: Tensor | None = None) -> Tensor:
        w = self.weight if lam is None else lam * self.weight
        return F.linear(x, w.type_as(x))


class Fp8QKV(PlainQKV):
    """#344: the same projection with FP8 products in training, from copies refreshed after each step."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        rows = (out_features, in_features)
        self.register_buffer("w_f8", torch.zeros(rows, dtype=torch.float8_e4m3fn), persistent=False)
        self.register_buffer("w_f8_t", torch.zeros(rows[::-1], dtype=torch.float8_e4m3fn), persistent=False)
        self.register_buffer("w_scale", torch.ones(1), persistent=False)

    @torch.no_grad()
    def refresh_fp8(self, step: int) -> None:
        """After optimizer step `step` (−1 before the first forward): the e4m3 copies of the current weight
        (#344 has no bootstrap or delayed scale here, so `step` is unused)."""
        for buf, value in zip((self.w_f8, self.w_f8_t, self.w_scale), weight_fp8(self.weight), strict=True):
            buf.copy_(value)  # in place: a compiled step keeps reading the same buffers

    def project(self, x: Tensor, lam: Tensor | None = None) -> Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return super().project(x, lam)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        lam = self.w_scale.new_ones(()) if lam is None else lam
        tokens = x.numel() // x.size(-1)  # the mean loss's gradient is 1/tokens of the record's summed one
        return _PackedFp8.apply(
            x, self.weight, lam, self.w_f8, self.w_f8_t, self.w_scale, dtype, GRAD_SCALE / tokens
        )
