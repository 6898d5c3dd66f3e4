"""Symmetric Gram matmuls of the orthogonalization step (twins: ``gram`` and ``ba_plus_caa`` in
optim/orthogonalize.py).

X·Xᵀ and b·A + c·A·A (A symmetric, so A·A = A·Aᵀ) are symmetric: one program per output tile on or
above the diagonal computes it (fp32 accumulation, the epilogue b·A + c·acc in fp32) and writes it twice,
in place and mirrored, so about half the tiles' work is skipped (the idea of the records' XXT and
ba_plus_cAA kernels). Each is a torch custom op, opaque to dynamo and inductor, so a compiled optimizer
step calls it inside its graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from speedrun import ops
from speedrun.perf.kernels.interpreter import interpreting

#: dtypes the kernel takes (fp64 and others run the plain op)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _sym_gram_kernel(
    x_ptr, c_ptr, M, K,
    sxb, sxm, sxk, scb, scm, scn,
    alpha, beta,
    ADD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, WIDEN: tl.constexpr,
):  # fmt: skip
    """Tile (pm, pn) of C = alpha·X·Xᵀ (+ beta·X when ADD, X square) for matrix b of the batch."""
    b = tl.program_id(0)
    pm = tl.program_id(1)
    pn = tl.program_id(2)
    if pn < pm:  # below the diagonal: the mirror of tile (pn, pm) writes it
        return
    rows = pm * BLOCK + tl.arange(0, BLOCK)
    cols = pn * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    x = x_ptr + b * sxb
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        in_k = kk[None, :] < K
        left = tl.load(
            x + rows[:, None] * sxm + kk[None, :] * sxk, mask=(rows[:, None] < M) & in_k, other=0.0
        )
        right = tl.load(
            x + cols[:, None] * sxm + kk[None, :] * sxk, mask=(cols[:, None] < M) & in_k, other=0.0
        )
        if WIDEN:
            left, right = left.to(tl.float32), right.to(tl.float32)
        acc = tl.dot(left, tl.trans(right), acc, input_precision=PRECISION)
    inside = (rows[:, None] < M) & (cols[None, :] < M)
    if ADD:
        own = tl.load(x + rows[:, None] * sxm + cols[None, :] * sxk, mask=inside, other=0.0)
        acc = alpha * acc + beta * own.to(tl.float32)
    out = acc.to(c_ptr.dtype.element_ty)
    c = c_ptr + b * scb
    tl.store(c + rows[:, None] * scm + cols[None, :] * scn, out, mask=inside)
    if pn > pm:
        mirrored = (cols[:, None] < M) & (rows[None, :] < M)
        tl.store(c + cols[:, None] * scm + rows[None, :] * scn, tl.trans(out), mask=mirrored)


def _launch(x: Tensor, alpha: float, beta: float, add: bool) -> Tensor:
    n, m, k = x.shape
    out = torch.empty(n, m, m, dtype=x.dtype, device=x.device)
    block, block_k = (128, 64) if m >= 512 else (64, 32)
    grid = (n, triton.cdiv(m, block), triton.cdiv(m, block))
    _sym_gram_kernel[grid](
        x, out, m, k, *x.stride(), *out.stride(), alpha, beta,
        ADD=add, BLOCK=block, BLOCK_K=block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        WIDEN=interpreting(), num_warps=8 if block == 128 else 4, num_stages=3,
    )  # fmt: skip
    return out


@torch.library.custom_op("speedrun::sym_gram", mutates_args=())
def sym_gram(x: Tensor) -> Tensor:
    """X·Xᵀ for x (n, m, k)."""
    return _launch(x, 1.0, 0.0, add=False)


@sym_gram.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(x.size(0), x.size(1), x.size(1))


@torch.library.custom_op("speedrun::sym_ba_plus_caa", mutates_args=())
def sym_ba_plus_caa(a: Tensor, b: float, c: float) -> Tensor:
    """b·A + c·A·Aᵀ for a (n, m, m)."""
    return _launch(a, c, b, add=True)


@sym_ba_plus_caa.register_fake
def _(a: Tensor, b: float, c: float) -> Tensor:
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def gram(x: Tensor) -> Tensor:
    """Replaces op `gram` (a batch (n, m, k) of a dtype the kernel takes; anything else: the plain op)."""
    if x.ndim != 3 or x.dtype not in DTYPES:
        return ops.plain("gram")(x)
    return sym_gram(x)


def ba_plus_caa(a: Tensor, b: float, c: float) -> Tensor:
    """Replaces op `ba_plus_caa` (a must be symmetric: it is a Gram matrix)."""
    if a.ndim != 3 or a.dtype not in DTYPES or a.size(-1) != a.size(-2):
        return ops.plain("ba_plus_caa")(a, b, c)
    return sym_ba_plus_caa(a, float(b), float(c))
