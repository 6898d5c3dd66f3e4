"""The 2025–26 Muon pieces of modded-nanogpt HEAD, one pure function each (the optimizer is optim/sharded.py).

Per matrix, one NorMuon step is (records #38, #41/#42/#48, #43, #57)::

    buf ← lerp(buf, g, 1 − μ);  d ← lerp(g, buf, μ)               # Nesterov, fp32 (``nesterov_``)
    V   ← polar_express(d)                                        # bf16, optim/orthogonalize.py
    V   ← NorMuon(V, v; β2)                                       # ``normuon_normalize_``
    W   ← W − W·[V·W ≥ 0]·(wd·lr)·lr_eff − V·lr_eff               # ``cautious_step``, lr_eff = lr·mult
    bf16 W is stepped in fp32: W32 = (bits(W) << 16) | mantissa    # ``join_fp32`` / ``split_fp32``

Momentum μ warms up and cools down linearly (``momentum_at``, record #39).
"""

from __future__ import annotations

import torch
from torch import Tensor


def nesterov_(grad: Tensor, buf: Tensor, momentum: float) -> Tensor:
    """Update ``buf`` in place (EMA of gradients) and return the Nesterov direction lerp(g, buf, μ).

    ``grad`` is overwritten with the direction (the record's lerp_ on the gradient chunk)."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp_(buf, momentum)


def variance_axis(rows: int, cols: int, square: str = "rows") -> int:
    """The dim NorMuon averages over: the columns (one statistic per row) of a tall matrix, the rows
    (one per column) of a wide one, so the statistics run along the longer side (#48). A square matrix
    gets one per row (``square="rows"``, #48 on) or one per column (``"cols"``: #41–#47 decide by the
    stored parameter, and their attention matrices are (768, 768) blocks of a wide (768, 3072) one).
    ``"all-rows"``: one per row whatever the shape (#48–#55's attention gates)."""
    if square == "all-rows":  # #48's attention gates (heads, 12): one statistic per head, whatever the shape
        return -1
    if rows == cols:
        return -1 if square == "rows" else -2
    return -1 if rows > cols else -2


def second_moment_shape(shape: tuple[int, ...], square: str = "rows") -> tuple[int, ...]:
    """Shape of NorMuon's second-moment buffer for a (..., rows, cols) stack."""
    *lead, rows, cols = shape
    return (*lead, rows, 1) if variance_axis(rows, cols, square) == -1 else (*lead, 1, cols)


def normuon_normalize_(v: Tensor, second_moment: Tensor, beta2: float, square: str = "rows") -> Tensor:
    """NorMuon (#41): divide V by the root of an EMA of its row (or column) mean squares, then rescale
    each matrix back to its own Frobenius norm. ``second_moment`` (fp32) is updated in place; V (any
    dtype, (..., rows, cols)) is scaled in place and returned. Op order of HEAD's fused version (#48);
    #41/#42 take the two norms of V directly, the same values in exact arithmetic."""
    axis = variance_axis(*v.shape[-2:], square)
    size = v.size(axis)
    v_mean = v.float().square().mean(dim=axis, keepdim=True)
    v_norm = v_mean.sum(dim=(-2, -1), keepdim=True).mul_(size).sqrt_()
    second_moment.lerp_(v_mean.to(second_moment.dtype), 1 - beta2)
    step = second_moment.clamp_min(1e-10).rsqrt_()
    new_norm = ((v_mean * size) * step.float().square()).sum(dim=(-2, -1), keepdim=True).sqrt_()
    scale = step * (v_norm / new_norm.clamp_min_(1e-10))
    return v.mul_(scale.type_as(v))


def cautious_step(
    weight: Tensor, update: Tensor, lr: Tensor | float, decay: Tensor | float, gate: Tensor | None = None
) -> Tensor:
    """W − W·[U·W ≥ 0]·decay·lr − U·lr in fp32 (returns a new tensor): weight decay only where the
    update pushes the weight towards zero anyway (#43). NorMuon passes decay = wd·(scheduled lr).
    With ``gate`` the sign test reads it instead of U: W·[gate·W ≥ 0] (ANVIL's slow rail, #92)."""
    update = update.float()
    mask = ((update if gate is None else gate.float()) * weight) >= 0
    return weight - (weight * mask * decay * lr) - (update * lr)


def join_fp32(high: Tensor, mantissa: Tensor) -> Tensor:
    """fp32 values from bf16 bit patterns (uint16: sign, exponent, top 7 mantissa bits) and the low 16
    mantissa bits kept in a uint16 buffer (#57): (high << 16) | low, bit for bit."""
    assert high.dtype == mantissa.dtype == torch.uint16
    return ((high.to(torch.int32) << 16) | mantissa.to(torch.int32)).view(torch.float32)


def split_fp32(x: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of ``join_fp32``: the high 16 bits (a bf16 truncated, not rounded, as HEAD does) and
    the low 16 bits, both uint16. join_fp32(*split_fp32(x)) == x bit for bit."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits >> 16) & 0xFFFF).to(torch.uint16), (bits & 0xFFFF).to(torch.uint16)


def momentum_at(step: int, total: int, warmup: int, cooldown: int, low: float, high: float) -> float:
    """Muon momentum of step ``step`` of ``total``: from ``low`` up to ``high`` over the first ``warmup``
    steps, then back down to ``low`` over the last ``cooldown`` (HEAD's get_muon_momentum: 0.85 → 0.95
    over 300 steps, 0.95 → 0.85 over the last 50)."""
    start = total - cooldown
    if warmup > 0 and step < warmup:
        return low + (step / warmup) * (high - low)
    if cooldown > 0 and step > start:
        return high - ((step - start) / cooldown) * (high - low)
    return high
