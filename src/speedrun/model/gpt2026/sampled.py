"""#92's sampled softcapped cross-entropy in training (record #92 "ANVIL2", 2026-08-30, PR #360).

On the steps the stage plan gives a candidate count P (`train.stages` sampled=; train/stages.py), the
training loss normalizes over P classes instead of the whole vocabulary. The candidate set C of a
micro-batch is every class that is one of its targets, plus negatives up to P: the next classes of the
stride sweep k·stride mod V (`model.head.sampled_stride`, 20011 coprime with V = 50,304, so the sweep is a
permutation), skipping the targets, so C holds P distinct classes. The sweep starts at the step's
`sweep_start` (mod V), where the previous step's P ended, so across steps every class is visited alike
and no draw needs an RNG. Logits are x·W[C]ᵀ, softcapped as the head's (23·sigmoid((z + 5)/7.5)); the
negatives' logits are not reweighted (no log-Q correction): the loss is the plain softmax over C, biased,
which is why the record raises P and ends on the full softmax. Each row's log-sum-exp takes the cap's
bound as its max (the record's fixed-max LSE: the capped logit lies in (0, 2·cap]), shared by the MTP and
prefix terms. #53's MTP targets y_{t+k} are the micro-batch's own targets, so always in C; #88's prefix
target of a token is scored only where it is in C (the record's position −1 otherwise: prefix targets
never force a class into C). The sum is divided by B·T, as our full-softmax loss (the record sums).

Where we differ, for results that do not depend on the process count: the record builds one set per
rank (its one micro-batch) and starts each rank's sweep at V·rank/8 and its cursor moves by what the host
drew; here the set is a function of the step and the micro-batch alone (every micro-batch of a step
starts at the same place), so 1, 2 or 8 processes, and a resume, compute the same loss. Validation is
always the full softmax: `loss` refuses a model in eval mode.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from speedrun import ops
from speedrun.config.gpt2026.head import HeadConfig
from speedrun.model.fp8 import fp8_linear
from speedrun.model.layers import softcap

#: the device assert's text, which the training loop turns into one line naming the setting (train/loop.py)
TOO_MANY_TARGETS = "a micro-batch has more distinct targets than the sampled softmax's P"


def sweep(vocab: int, stride: int) -> torch.Tensor:
    """The negatives' order: k·stride mod V for k = 0 … V−1 (int64), a permutation of the classes."""
    assert math.gcd(stride, vocab) == 1, f"stride {stride} is not coprime with {vocab} classes"
    return torch.arange(vocab, dtype=torch.int64) * stride % vocab


def candidate_set(
    targets: torch.Tensor, count: int, start: torch.Tensor, order: torch.Tensor
) -> torch.Tensor:
    """The P = `count` candidates of a micro-batch (ascending class ids): every class in `targets`, then
    the first unmarked classes of `order` read cyclically from position `start` (0-d) until there are P.
    Runs on the device with static shapes (no host sync); refuses more distinct targets than P."""
    V = order.numel()
    mark = torch.zeros(V, dtype=torch.bool, device=order.device)
    mark[targets.reshape(-1)] = True
    n = mark.sum()
    torch._assert_async(n <= count, TOO_MANY_TARGETS)
    window = order[(torch.arange(V, device=order.device) + start) % V]  # the sweep from `start`, cyclic
    free = ~mark[window]
    take = free & (free.cumsum(0) <= count - n)  # the first P − n free classes of the window
    member = mark | torch.zeros_like(mark).scatter_(0, window, take)
    # the members' ids, ascending: a stable sort puts the P members (key 0) first, in id order
    return torch.sort((~member).to(torch.uint8), stable=True).indices[:count]


def positions(candidates: torch.Tensor, classes: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each class's position in C, −1 where it is not a candidate (or `classes` is −1)."""
    pos = torch.full((vocab + 1,), -1, dtype=torch.int64, device=candidates.device)  # entry V: for −1
    pos.scatter_(0, candidates, torch.arange(candidates.numel(), device=candidates.device))
    return pos[torch.where(classes >= 0, classes, vocab)]


def fixed_max_logsumexp(z: torch.Tensor, bound: float) -> torch.Tensor:
    """log Σ exp(z) over the last dim with `bound` (>= every z) as the max: bound + log Σ exp(z − bound).
    The record's CE kernel does this for the softcapped logits, whose bound is the cap's 2·cap."""
    return bound + torch.log(torch.exp(z - bound).sum(-1))


def loss(
    model: torch.nn.Module,
    x: torch.Tensor,
    targets: torch.Tensor,
    part: HeadConfig,
    count: int,
) -> torch.Tensor:
    """The training loss over the step's candidate set: final hidden x (B, T, d), targets (B, T), P."""
    assert model.training, "validation is the full softmax (#92: the sampled softmax is training-only)"
    B, T = targets.shape
    order = model.sampled_sweep
    V = order.numel()
    cand = candidate_set(targets, count, model.sampled_start, order)
    weight = model.lm_head.weight[cand]  # (P, d): the gradient reaches only the candidates' rows
    if part.fp8 and torch.is_grad_enabled():
        logits = fp8_linear(x, weight)
    else:
        logits = F.linear(x, weight.to(x.dtype))
    pos = positions(cand, targets, V)
    prefix_pos = None
    if model.prefix_weight is not None:  # #88: where the prefix target is a candidate
        prefix_pos = positions(cand, model.prefix_table[targets], V)
    total = sampled_softcapped_ce(
        logits, pos, model.mtp_weights, prefix_pos, model.prefix_weight,
        part.softcap, part.softcap_divisor, part.softcap_offset,
    )  # fmt: skip
    return total / (B * T)


@ops.plain_op("sampled_softcapped_ce")
def sampled_softcapped_ce(
    logits: torch.Tensor,
    pos: torch.Tensor,
    mtp_weights: torch.Tensor | None,
    prefix_pos: torch.Tensor | None,
    prefix_weight: torch.Tensor | None,
    cap: float,
    divisor: float,
    offset: float,
) -> torch.Tensor:
    """Candidate logits (B, T, P) → the softcap → the summed loss over C (not divided): MTP's weighted
    terms of the targets' positions `pos` (B, T) (weight 1 without MTP), plus the prefix term where
    `prefix_pos` (B, T) is a candidate (>= 0); every row's log-sum-exp with the cap's bound as its max."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (fp64 stays: the tests)
    z = softcap(z, cap, "sigmoid", divisor, offset)
    lse = fixed_max_logsumexp(z, 2 * cap)  # (B, T)
    weights = mtp_weights if mtp_weights is not None else torch.ones(1, device=z.device)
    total = mtp_sum(z, lse, pos, weights)
    if prefix_pos is not None:
        valid = prefix_pos >= 0
        ce = lse - z.gather(-1, prefix_pos.clamp(min=0)[..., None])[..., 0]
        total = total + prefix_weight * torch.where(valid, ce, torch.zeros_like(ce)).sum()
    return total


def mtp_sum(z: torch.Tensor, lse: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_t Σ_k w_k·(lse_t − z_t[pos_{t+k}]) within each row (head.mtp_loss's terms, before its mean)."""
    T, n = pos.size(1), weights.size(0)
    idx = F.pad(pos, (0, n - 1)).unfold(1, n, 1)  # (B, T, n): positions of y_t, y_{t+1}, …
    ce = lse[..., None] - z.gather(-1, idx)
    valid = torch.arange(T, device=z.device)[:, None] + torch.arange(n, device=z.device) < T
    return (torch.where(valid, ce, torch.zeros((), dtype=ce.dtype, device=ce.device)) * weights).sum()
