"""The head of the gpt2026 family: untied output matrix (zero, or normal(0, 0.005) with #51/#53), FP8
matmul in training (Sub3Min's scales), the sigmoid softcap c·2·sigmoid((z + offset)/divisor) (#26's
divisor, #54's offset) in the head's dtype or fp32, cross-entropy on bf16 logits in training (#37) and
multi-token prediction weighted by the stage (#53, model/mtp.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speedrun.model.fp8 import fp8_linear
from speedrun.model.layers import CastedLinear, softcap
from speedrun.model.mtp import mtp_loss


@dataclass(frozen=True)
class HeadSpec:
    cap: float
    divisor: float
    offset: float
    cap_in_head_dtype: bool
    ce_bf16: bool
    fp8: bool
    mtp: int


def capped_logits(head: CastedLinear, x: torch.Tensor, spec: HeadSpec, training: bool) -> torch.Tensor:
    """Logits (padded vocab) before the final fp32 cast: in the head's dtype where the cap runs in it."""
    if spec.fp8 and training and torch.is_grad_enabled():
        logits = fp8_linear(x, head.weight)
    else:
        logits = head(x)
    if spec.cap > 0:
        logits = logits if spec.cap_in_head_dtype else logits.float()
        logits = softcap(logits, spec.cap, "sigmoid", spec.divisor, spec.offset)
    return logits


def loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    spec: HeadSpec,
    training: bool,
    reduction: str,
    mtp_weights: torch.Tensor | None,
) -> torch.Tensor:
    """Cross-entropy (mean, sum or per position (B, T)); MTP's weighted sum in training (#53)."""
    B, T = targets.shape
    logits = logits if spec.ce_bf16 and training else logits.float()
    if mtp_weights is not None and training and reduction == "mean":
        return mtp_loss(logits, targets, mtp_weights)
    out = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction)
    return out.view(B, T) if reduction == "none" else out
