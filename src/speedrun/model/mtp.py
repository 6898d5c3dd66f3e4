"""Multi-token prediction (record #53, 2025-12-22, PR #178): in training, position t's logits are also
scored against the tokens k = 1, 2, … after its target, and the loss is the weighted sum
Σ_t Σ_k w_k·(logsumexp(z_t) − z_t[y_{t+k}]). The one head predicts them all; no extra parameters. The
weights decay over training (#53: [1, 0.5, 0.25 → 0], then [1, 0.5 → 0], then [1]: the stage plan's
`mtp=`), so the run ends on plain next-token prediction. Targets past a row's end count zero; within
a packed row they run on across document boundaries, as in the record. Validation is plain
cross-entropy.

The weights live in a fixed-length buffer (trailing zeros for heads a stage dropped), written in place
each step: a compiled forward sees new values, not a new graph."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mtp_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V), targets (B, T), weights (n,) → Σ w_k·CE(t, y_{t+k}) over every row and position,
    divided by B·T (our mean; the record sums). With weights (1, 0, …) it is the mean cross-entropy."""
    B, T, V = logits.shape
    n = weights.size(0)
    idx = F.pad(targets, (0, n - 1)).unfold(1, n, 1)  # (B, T, n): y_t, y_{t+1}, … (0 past the end)
    ce = torch.logsumexp(logits, dim=-1, keepdim=True) - logits.gather(-1, idx)  # (B, T, n)
    valid = torch.arange(T, device=logits.device)[:, None] + torch.arange(n, device=logits.device) < T
    ce = torch.where(valid, ce, torch.zeros((), dtype=ce.dtype, device=ce.device))
    return (ce * weights).sum() / (B * T)  # bf16 cross-entropies x fp32 weights: summed in fp32, as #53


def write_weights(buffer: torch.Tensor, weights: tuple[float, ...]) -> None:
    """Write a stage's weights into the model's buffer in place, zeros after them."""
    assert len(weights) <= buffer.numel(), f"{len(weights)} MTP weights for {buffer.numel()} predicted tokens"
    padded = list(weights) + [0.0] * (buffer.numel() - len(weights))
    buffer.copy_(torch.tensor(padded, dtype=buffer.dtype))
