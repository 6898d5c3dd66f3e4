"""The records' loss head from #53 on, written once: #53's multi-token-prediction loss, and the head #54
(2025-12-26_LogitRescale) introduced and every script to #89 keeps: #40's backout subtracted, the normed
stream through the tied-or-not head, 23·σ((logits + 5)/7.5), then the MTP loss in training when it weighs
several tokens, else cross-entropy (summed in training, the mean at evaluation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def record_mtp_loss(
    logits: torch.Tensor, target_seq: torch.Tensor, mtp_weights: torch.Tensor
) -> torch.Tensor:
    """#53's GPT.forward, training branch with n_predict > 1 (one packed row, summed)."""
    n_predict = mtp_weights.size(0)
    idx = F.pad(target_seq, (0, n_predict - 1)).unfold(0, n_predict, 1)
    target_logits = logits.gather(1, idx)
    cross_entropy = torch.logsumexp(logits, dim=-1).unsqueeze(1) - target_logits
    for k in range(1, n_predict):
        cross_entropy[-k:, k] = 0
    return (cross_entropy * mtp_weights).sum()


def record_54_loss(w, x, x_backout, target_seq, mtp, training: bool) -> torch.Tensor:
    """The end of GPT.forward from #54 on (x: the stream after the last block, (1, T, d))."""
    x = x - w["backout.lamb"] * x_backout
    logits = 23 * torch.sigmoid((F.linear(F.rms_norm(x, (x.size(-1),)), w["lm_head.weight"]) + 5) / 7.5)[0]
    if training and len(mtp) > 1:
        return record_mtp_loss(logits, target_seq, torch.tensor(mtp))
    return F.cross_entropy(logits, target_seq, reduction="sum" if training else "mean")
