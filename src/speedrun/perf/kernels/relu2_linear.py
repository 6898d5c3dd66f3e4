"""The MLP's up-projection with its ReLU² in the matmul's epilogue (twin: ``relu2_linear`` in
model/layers.py; the records' fused MLP kernel).

Forward: one tiled matmul H = X·Wᵀ (fp32 accumulation) whose epilogue writes both the pre-activation H
(saved for backward) and ReLU(H)² in X's dtype, so the activation costs no pass of its own. Backward in
plain torch: dH = g·2·ReLU(H), dX = dH·W, dW = dHᵀ·X.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from speedrun import ops
from speedrun.perf.kernels.interpreter import interpreting

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _relu2_linear_kernel(
    x_ptr, w_ptr, pre_ptr, out_ptr, M, N, K,
    sxm, sxk, swn, swk, som, son,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + ks
        in_k = kk[None, :] < K
        a = tl.load(
            x_ptr + rows[:, None] * sxm + kk[None, :] * sxk, mask=(rows[:, None] < M) & in_k, other=0.0
        )
        w = tl.load(
            w_ptr + cols[:, None] * swn + kk[None, :] * swk, mask=(cols[:, None] < N) & in_k, other=0.0
        )
        if WIDEN:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * som + cols[None, :] * son
    pre = acc.to(pre_ptr.dtype.element_ty)
    tl.store(pre_ptr + offs, pre, mask=inside)
    act = tl.maximum(pre.to(tl.float32), 0.0)  # from the rounded H, as the plain op squares it
    tl.store(out_ptr + offs, (act * act).to(out_ptr.dtype.element_ty), mask=inside)


@torch.library.custom_op("speedrun::relu2_linear_fwd", mutates_args=())
def relu2_linear_fwd(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K), w (N, K) → (ReLU(x·wᵀ)², x·wᵀ), both (M, N) in x's dtype."""
    M, K = x.shape
    N = w.size(0)
    pre = torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = torch.empty_like(pre)
    big = M >= 1024 and N >= 1024
    bm, bn, bk = (128, 128, 64) if big else (32, 32, 32)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _relu2_linear_kernel[grid](
        x, w, pre, out, M, N, K, *x.stride(), *w.stride(), *pre.stride(),
        BM=bm, BN=bn, BK=bk, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", WIDEN=interpreting(),
        num_warps=8 if big else 4, num_stages=3,
    )  # fmt: skip
    return out, pre


@relu2_linear_fwd.register_fake
def _(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    out = x.new_empty(x.size(0), w.size(0))
    return out, torch.empty_like(out)


def _setup(ctx, inputs, output) -> None:
    x, w = inputs
    ctx.save_for_backward(x, w, output[1])


def _backward(ctx, g_out: Tensor, g_pre: Tensor | None):
    x, w, pre = ctx.saved_tensors
    d_pre = g_out * (2 * torch.relu(pre))
    return d_pre @ w, d_pre.mT @ x


relu2_linear_fwd.register_autograd(_backward, setup_context=_setup)


def relu2_linear(x: Tensor, weight: Tensor) -> Tensor:
    """Replaces op `relu2_linear` (x (..., K) and weight (N, K) of one dtype the kernel takes)."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype or x.ndim < 2:
        return ops.plain("relu2_linear")(x, weight)
    out, _ = relu2_linear_fwd(x.reshape(-1, x.size(-1)), weight)
    return out.view(*x.shape[:-1], weight.size(0))
