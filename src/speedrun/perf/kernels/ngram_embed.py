"""The n-gram table's gather and its sparse-gradient sink (twin: ``ngram_embed`` in model/gpt2026/ngram.py;
#92's n-gram lookup kernel).

Forward, one program per token: load the token's bigram and trigram rows of the source (the table, or the
rows a sharded table pulled), multiply each by its ±1 sign row of the pool, add, and store once in the
source's dtype (the products are exact, the one rounding is the store's, as the twin's). The sign rows are
the twin's (`ngram_signs`, computed by torch before the call). As a custom op the result is opaque to
AOTAutograd's partitioner, which would otherwise inline the recomputable gathers into every consumer of
the n-gram input (the record's reason for the kernel).

Backward (the sink), one program per token: the incoming gradient times each channel's sign row is
scatter-added into its row of an fp32 buffer of the source's shape with atomics (rows repeat within and
across tokens: every share lands), then cast once to the source's dtype. No (B, 2T, d) gathered rows are
kept for the backward: only the slots and sign rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from speedrun import ops

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rows_of(n, T, slots_ptr, sb_ptr, st_ptr):
    """Token n = b·T + t: its bigram and trigram rows and their sign-pool rows."""
    b, t = n // T, n % T
    rb = tl.load(slots_ptr + b * 2 * T + t).to(tl.int64)
    rt = tl.load(slots_ptr + b * 2 * T + T + t).to(tl.int64)
    pb = tl.load(sb_ptr + n).to(tl.int64)
    pt = tl.load(st_ptr + n).to(tl.int64)
    return rb, rt, pb, pt


@triton.jit
def _gather_kernel(src_ptr, slots_ptr, sb_ptr, st_ptr, pool_ptr, out_ptr, T, D, s_row, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)  # token b·T + t
    rb, rt, pb, pt = _rows_of(n, T, slots_ptr, sb_ptr, st_ptr)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        inside = cols < D
        a = tl.load(src_ptr + rb * s_row + cols, mask=inside, other=0.0).to(tl.float32)
        c = tl.load(src_ptr + rt * s_row + cols, mask=inside, other=0.0).to(tl.float32)
        sa = tl.load(pool_ptr + pb * D + cols, mask=inside, other=0.0).to(tl.float32)
        sc = tl.load(pool_ptr + pt * D + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * D + cols, (a * sa + c * sc).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _sink_kernel(g_ptr, slots_ptr, sb_ptr, st_ptr, pool_ptr, acc_ptr, T, D, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    rb, rt, pb, pt = _rows_of(n, T, slots_ptr, sb_ptr, st_ptr)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        inside = cols < D
        g = tl.load(g_ptr + n * D + cols, mask=inside, other=0.0).to(tl.float32)
        sa = tl.load(pool_ptr + pb * D + cols, mask=inside, other=0.0).to(tl.float32)
        sc = tl.load(pool_ptr + pt * D + cols, mask=inside, other=0.0).to(tl.float32)
        tl.atomic_add(acc_ptr + rb * D + cols, g * sa, mask=inside)
        tl.atomic_add(acc_ptr + rt * D + cols, g * sc, mask=inside)


def block_d(D: int) -> int:
    """Row tile: 256 columns (a 768-wide row is 3 tiles); 32 for small test widths (ragged)."""
    return 256 if D >= 256 else 32


@torch.library.custom_op("speedrun::ngram_gather", mutates_args=())
def ngram_gather(source: Tensor, slots: Tensor, sb: Tensor, st: Tensor, pool: Tensor) -> Tensor:
    """source (R, d), slots (B, 2T), sign rows sb, st (B, T), pool (S, d) → (B, T, d) in source's dtype."""
    B, T = sb.shape
    D = source.size(1)
    out = torch.empty(B, T, D, dtype=source.dtype, device=source.device)
    _gather_kernel[(B * T,)](
        source, slots.contiguous(), sb.contiguous(), st.contiguous(), pool.contiguous(), out,
        T, D, source.stride(0), BLOCK_D=block_d(D),
    )  # fmt: skip
    return out


@ngram_gather.register_fake
def _(source: Tensor, slots: Tensor, sb: Tensor, st: Tensor, pool: Tensor) -> Tensor:
    return source.new_empty(*sb.shape, source.size(1))


@torch.library.custom_op("speedrun::ngram_sink", mutates_args=())
def ngram_sink(g: Tensor, source: Tensor, slots: Tensor, sb: Tensor, st: Tensor, pool: Tensor) -> Tensor:
    """d out (B, T, d) → d source (R, d): each token's gradient times its sign rows, scatter-added."""
    B, T = sb.shape
    R, D = source.shape
    acc = torch.zeros(R, D, dtype=torch.float32, device=source.device)
    _sink_kernel[(B * T,)](
        g.contiguous(), slots.contiguous(), sb.contiguous(), st.contiguous(), pool.contiguous(), acc,
        T, D, BLOCK_D=block_d(D),
    )  # fmt: skip
    return acc.to(source.dtype)


@ngram_sink.register_fake
def _(g: Tensor, source: Tensor, slots: Tensor, sb: Tensor, st: Tensor, pool: Tensor) -> Tensor:
    return torch.empty_like(source)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, g: Tensor):
    source, slots, sb, st, pool = ctx.saved_tensors
    return ngram_sink(g, source, slots, sb, st, pool), None, None, None, None


ngram_gather.register_autograd(_backward, setup_context=_setup)


def ngram_embed(source: Tensor, slots: Tensor, sb: Tensor, st: Tensor, pool: Tensor) -> Tensor:
    """Replaces op `ngram_embed`: the same rows summed (one rounding), the same gradient of `source`."""
    if source.dtype not in DTYPES or source.ndim != 2 or pool.size(1) != source.size(1):
        return ops.plain("ngram_embed")(source, slots, sb, st, pool)
    return ngram_gather(source, slots, sb, st, pool)
