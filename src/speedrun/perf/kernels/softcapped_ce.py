"""The softcapped cross-entropy, forward and backward in one kernel (twin: ``softcapped_ce`` in
model/gpt2026/head.py; the records' fused CE, #43 on).

One program per row of raw logits l (padded vocabulary V): the sigmoid softcap z = A·σ((l + B)/C)
(A = 2·cap, B = offset, C = divisor or cap/2) is bounded by A, so exp(z − A) needs no running maximum and
lse = A + log Σ exp(z − A) takes one pass over the row. The row's loss is Σ_p w_p·(lse − z[t_p]) over
its target columns t_p (P = 1: next-token CE, w = 0 where the target is ignored; P > 1: MTP, w_p the
stage's weight, 0 past the row's end), and a second pass writes the gradient of that loss with respect
to l: (Σ_p w_p·softmax(z) − Σ_p w_p·[v = t_p])·(A/C)·σ·(1 − σ). No capped or fp32 logits are stored;
the backward only scales the saved gradient by its row's incoming gradient.

Three ops use the one row kernel, each a column layout: `softcapped_ce` (the next-token or MTP columns),
`softcapped_prefix_ce` (#88: one more column, the prefix target table[y], weighted w/(B·T) where it
exists; twin in model/gpt2026/head.py) and `sampled_softcapped_ce` (#92: the rows are the candidates'
logits (B, T, P), the columns the targets' positions in C and the prefix targets' where they are
candidates; twin in model/gpt2026/sampled.py, whose fixed-max LSE is this kernel's bound-as-max one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from speedrun import ops

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
IGNORE_INDEX = -100  # F.cross_entropy's default, which the plain op uses


@triton.jit
def _ce_rows_kernel(
    raw_ptr, idx_ptr, w_ptr, loss_ptr, grad_ptr,
    V, s_row, s_col, g_row,
    A, B, C,
    P: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    raw = raw_ptr + row * s_row
    offs = tl.arange(0, BLOCK_V)
    total = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        inside = cols < V
        z = A * tl.sigmoid((tl.load(raw + cols * s_col, mask=inside, other=0.0).to(tl.float32) + B) / C)
        total += tl.where(inside, tl.exp(z - A), 0.0)
    lse = A + tl.log(tl.sum(total, axis=0))
    loss = 0.0
    wsum = 0.0
    for p in tl.static_range(P):
        t = tl.load(idx_ptr + row * P + p)
        w = tl.load(w_ptr + row * P + p)
        zt = A * tl.sigmoid((tl.load(raw + t * s_col).to(tl.float32) + B) / C)
        loss += w * (lse - zt)
        wsum += w
    tl.store(loss_ptr + row, loss)
    grad = grad_ptr + row * g_row
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        inside = cols < V
        s = tl.sigmoid((tl.load(raw + cols * s_col, mask=inside, other=0.0).to(tl.float32) + B) / C)
        dz = wsum * tl.exp(A * s - lse)
        for p in tl.static_range(P):
            t = tl.load(idx_ptr + row * P + p)
            w = tl.load(w_ptr + row * P + p)
            dz -= tl.where(cols == t, w, 0.0)
        g = dz * (A / C) * s * (1.0 - s)
        tl.store(grad + cols, g.to(grad_ptr.dtype.element_ty), mask=inside)


def block_v(V: int) -> int:
    """Vocabulary tile: 2048 columns for GPT-2's vocabulary; 128 for small test vocabularies (ragged)."""
    return 2048 if V >= 8192 else 128


@torch.library.custom_op("speedrun::softcapped_ce_rows", mutates_args=())
def softcapped_ce_rows(
    raw: Tensor, idx: Tensor, w: Tensor, A: float, B: float, C: float
) -> tuple[Tensor, Tensor]:
    """Raw logits (N, V), target columns idx (N, P) int64, weights w (N, P) fp32 → (per-row losses (N,)
    fp32, d loss_row / d raw (N, V) in raw's dtype)."""
    N, V = raw.shape
    losses = torch.empty(N, dtype=torch.float32, device=raw.device)
    grad = torch.empty(N, V, dtype=raw.dtype, device=raw.device)
    bv = block_v(V)
    _ce_rows_kernel[(N,)](
        raw, idx.contiguous(), w.contiguous(), losses, grad, V, raw.stride(0), raw.stride(1), grad.stride(0),
        A, B, C, P=idx.size(1), BLOCK_V=bv, num_warps=8 if bv >= 2048 else 4,
    )  # fmt: skip
    return losses, grad


@softcapped_ce_rows.register_fake
def _(raw: Tensor, idx: Tensor, w: Tensor, A: float, B: float, C: float) -> tuple[Tensor, Tensor]:
    return raw.new_empty(raw.size(0), dtype=torch.float32), raw.new_empty(raw.shape)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])


def _backward(ctx, g_losses: Tensor, g_grad: Tensor | None):
    (grad,) = ctx.saved_tensors
    return grad * g_losses[:, None].to(grad.dtype), None, None, None, None, None


softcapped_ce_rows.register_autograd(_backward, setup_context=_setup)


def softcapped_ce(
    raw: Tensor,
    targets: Tensor,
    mtp_weights: Tensor | None,
    cap: float,
    divisor: float,
    offset: float,
    cap_in_bf16: bool,
    ce_bf16: bool,
) -> Tensor:
    """Replaces op `softcapped_ce`: the same mean loss (fp32; the kernel computes in fp32 whatever the
    plain op's `cap_in_bf16`/`ce_bf16`), from raw logits (B, T, V) of a dtype it takes."""
    if raw.ndim != 3 or raw.dtype not in DTYPES:
        plain = ops.plain("softcapped_ce")
        return plain(raw, targets, mtp_weights, cap, divisor, offset, cap_in_bf16, ce_bf16)
    idx, w, denom = _columns(targets, mtp_weights)
    losses, _ = softcapped_ce_rows(raw.reshape(-1, raw.size(-1)), idx, w, *_abc(cap, divisor, offset))
    return losses.sum() / denom


def _abc(cap: float, divisor: float, offset: float) -> tuple[float, float, float]:
    """The kernel's A·σ((l + B)/C) of the head's sigmoid softcap."""
    return 2.0 * cap, float(offset), float(divisor or cap / 2)


def _columns(targets: Tensor, mtp_weights: Tensor | None) -> tuple[Tensor, Tensor, Tensor | int]:
    """Each row's target columns (N, n) and weights (N, n), and the mean's denominator: next-token CE
    over the targets not ignored, or #53's MTP (position t against y_{t+k}, weight w_k, zero past the
    row's end) over every position."""
    Bt, T = targets.shape
    if mtp_weights is None:
        t = targets.reshape(-1, 1)
        keep = t != IGNORE_INDEX
        idx, w = torch.where(keep, t, 0), keep.float()
        return idx, w, w.sum()
    n = mtp_weights.numel()
    idx = F.pad(targets, (0, n - 1)).unfold(1, n, 1).reshape(-1, n)
    ahead = torch.arange(T, device=targets.device)[:, None] + torch.arange(n, device=targets.device) < T
    w = (ahead * mtp_weights.float()).expand(Bt, T, n).reshape(-1, n)
    return idx, w, Bt * T


def _optional_column(idx: Tensor, w: Tensor, cols: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """One more target column per row: `cols` (N,) scored with `weight` where >= 0, nothing where −1."""
    valid = cols >= 0
    idx = torch.cat([idx, torch.where(valid, cols, 0)[:, None]], dim=1)
    return idx, torch.cat([w, (valid * weight.float())[:, None]], dim=1)


def softcapped_prefix_ce(
    raw: Tensor,
    targets: Tensor,
    mtp_weights: Tensor | None,
    table: Tensor,
    weight: Tensor,
    cap: float,
    divisor: float,
    offset: float,
    cap_in_bf16: bool,
    ce_bf16: bool,
) -> Tensor:
    """Replaces op `softcapped_prefix_ce` (#88): the prefix target table[y] is one more column of each
    row, weighted w/(B·T) where it exists, in the same pass as the next-token (or MTP) columns."""
    if raw.ndim != 3 or raw.dtype not in DTYPES:
        plain = ops.plain("softcapped_prefix_ce")
        return plain(raw, targets, mtp_weights, table, weight, cap, divisor, offset, cap_in_bf16, ce_bf16)
    Bt, T, V = raw.shape
    idx, w, denom = _columns(targets, mtp_weights)
    idx, w = _optional_column(idx, w / denom, table[targets].reshape(-1), weight / (Bt * T))
    losses, _ = softcapped_ce_rows(raw.reshape(-1, V), idx, w, *_abc(cap, divisor, offset))
    return losses.sum()


def sampled_softcapped_ce(
    logits: Tensor,
    pos: Tensor,
    mtp_weights: Tensor | None,
    prefix_pos: Tensor | None,
    prefix_weight: Tensor | None,
    cap: float,
    divisor: float,
    offset: float,
) -> Tensor:
    """Replaces op `sampled_softcapped_ce` (#92): the rows are the candidates' logits (B, T, P), the
    columns the targets' positions in C (and the prefix targets' where they are candidates); the
    kernel's bound-as-max log-sum-exp is the record's fixed-max one. Returns the sum, as the twin."""
    if logits.ndim != 3 or logits.dtype not in DTYPES:
        plain = ops.plain("sampled_softcapped_ce")
        return plain(logits, pos, mtp_weights, prefix_pos, prefix_weight, cap, divisor, offset)
    weights = mtp_weights if mtp_weights is not None else torch.ones(1, device=logits.device)
    idx, w, _ = _columns(pos, weights)
    if prefix_pos is not None:
        idx, w = _optional_column(idx, w, prefix_pos.reshape(-1), prefix_weight)
    losses, _ = softcapped_ce_rows(logits.reshape(-1, logits.size(-1)), idx, w, *_abc(cap, divisor, offset))
    return losses.sum()
