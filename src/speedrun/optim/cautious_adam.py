"""Adam as modded-nanogpt HEAD steps it (records #50, #52, #56): fp32 state, the paper's bias
correction folded into the step size, and cautious decoupled weight decay.

    m ← β1·m + (1 − β1)·g;   v ← β2·v + (1 − β2)·g²
    U ← m / (√v + ε) · lr·√(1 − β2ᵗ)/(1 − β1ᵗ)
    U ← U + W·[U·W > 0]·lr²·wd                      # decay only where the step already shrinks W
    W ← W − U

lr here is the label's scheduled LR (its multiplier included) and wd the label's decay (its
multiplier included); the decay scales with lr², so it fades with the LR schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class AdamLabel:
    """Hyperparameters shared by every parameter with one label (embed, head, value_embed, scalar)."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float  # already multiplied by the label's multiplier
    eps: float


def cautious_adam_(
    weight: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, lr: float, hp: AdamLabel
) -> None:
    """One Adam step of ``weight`` (in place) at step count ``step`` (>= 1) with LR ``lr``.

    The math runs in fp32 (state is fp32); a bf16 weight receives the rounded result."""
    beta1, beta2 = hp.betas
    g = grad.float()
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr * ((1 - beta2**step) ** 0.5 / (1 - beta1**step))
    update = exp_avg.div(exp_avg_sq.sqrt().add_(hp.eps)).mul_(step_size)
    w = weight.float()
    if hp.weight_decay:
        mask = (update * w) > 0
        update.addcmul_(w, mask, value=lr * lr * hp.weight_decay)
    if w is weight:
        weight.sub_(update)
    else:
        weight.copy_(w - update)


def adam_foreach_(
    weights: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: int,
    lr: float,
    hp: AdamLabel,
) -> None:
    """``cautious_adam_`` on many fp32 tensors of one label without decay, as multi-tensor ops (one
    launch per op on CUDA instead of one per tensor); element for element the same arithmetic."""
    assert not hp.weight_decay and all(w.dtype == torch.float32 for w in weights)
    beta1, beta2 = hp.betas
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    step_size = lr * ((1 - beta2**step) ** 0.5 / (1 - beta1**step))
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, hp.eps)
    updates = torch._foreach_div(exp_avgs, denom)
    torch._foreach_mul_(updates, step_size)
    torch._foreach_sub_(weights, updates)
