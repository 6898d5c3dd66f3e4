"""The row-compacted Adam step of the n-gram table (twin: ``row_adam_rows`` in optim/row_adam.py; #92's
n-gram Adam kernel), for #92's case: β1 = 0 and one second moment per row.

One program per touched row (distinct; the caller summed repeated rows' gradients): read the step the
row is current to, replay the steps it slept through (v ← v·exp(Σ log β2 over them), from the optimizer's
running sum, in fp64 as the twin), then the step itself in fp32: v ← β2·v + (1 − β2)·mean(g²) (a first
pass over the row's tiles), U = g/(√v + ε)·lr·√(1 − β2ᵗ), the cautious decay U + W·[U·W > 0]·lr²·wd, and
W − U stored in the table's dtype (a second pass). One launch instead of the twin's chain of gathers,
elementwise ops and scatters over the touched rows. Other cases (β1 > 0, a per-element second moment,
an fp64 table) run the twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from speedrun import ops

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _row_adam_kernel(
    table_ptr, v_ptr, current_ptr, logs_ptr, rows_ptr, g_ptr,
    s, D, s_row, beta2, step_size, decay, eps,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + i).to(tl.int64)
    last = tl.load(current_ptr + r).to(tl.int64)
    factor = tl.exp(tl.load(logs_ptr + s - 1) - tl.load(logs_ptr + last)).to(tl.float32)
    offs = tl.arange(0, BLOCK_D)
    sq = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + offs
        g = tl.load(g_ptr + i * D + cols, mask=cols < D, other=0.0)
        sq += g * g
    v = tl.load(v_ptr + r) * factor
    v = v * beta2 + (1.0 - beta2) * (tl.sum(sq, axis=0) / D)
    tl.store(v_ptr + r, v)
    denom = tl.sqrt(v) + eps
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + offs
        inside = cols < D
        g = tl.load(g_ptr + i * D + cols, mask=inside, other=0.0)
        w = tl.load(table_ptr + r * s_row + cols, mask=inside, other=0.0).to(tl.float32)
        u = g / denom * step_size
        u = u + tl.where(u * w > 0, w, 0.0) * decay
        tl.store(table_ptr + r * s_row + cols, (w - u).to(table_ptr.dtype.element_ty), mask=inside)


def row_adam_rows(opt, rows: Tensor, g: Tensor) -> None:
    """Replaces op `row_adam_rows`: the same step of `opt` (optim/row_adam.RowAdam) on `rows` in place."""
    table = opt.table
    if opt.beta1 != 0.0 or not opt.row_moment or table.dtype not in DTYPES or rows.numel() == 0:
        return ops.plain("row_adam_rows")(opt, rows, g)
    s = opt.steps
    lr, beta2, wd = opt.hyper[s]
    D = table.size(1)
    _row_adam_kernel[(rows.numel(),)](
        table, opt.exp_avg_sq, opt.current, opt._logs, rows.contiguous(), g.float().contiguous(),
        s, D, table.stride(0), beta2, lr * (1 - beta2**s) ** 0.5, lr * lr * wd, opt.eps,
        BLOCK_D=256 if D >= 256 else 32,
    )  # fmt: skip
