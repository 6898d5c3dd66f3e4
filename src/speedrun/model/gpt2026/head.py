"""The head of the gpt2026 family: untied output matrix (zero, or normal(0, 0.005) with #51/#53), FP8
matmul in training (Sub3Min's scales), the sigmoid softcap c·2·sigmoid((z + offset)/divisor) (#26's
divisor, #54's offset) in the head's dtype or fp32, cross-entropy on bf16 logits in training (#37) and
multi-token prediction weighted by the stage (#53, below)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speedrun import ops
from speedrun.config.gpt2026.head import HeadConfig
from speedrun.data.tokenizers import gpt2_tokenizer
from speedrun.model.fp8 import head_logits
from speedrun.model.gpt2026 import canonical, prefix, sampled
from speedrun.model.layers import CastedLinear, softcap


def capped_logits(head: CastedLinear, x: torch.Tensor, part: HeadConfig) -> torch.Tensor:
    """Logits (padded vocab) before the final fp32 cast: in the head's dtype where the cap runs in it;
    `part`: the head's own `[model.head]` table (frozen), which the model keeps."""
    logits = head_logits(head, x, part.fp8)
    if part.softcap > 0:
        logits = logits if part.softcap_in_bf16 else logits.float()
        logits = softcap(logits, part.softcap, "sigmoid", part.softcap_divisor, part.softcap_offset)
    return logits


def loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    part: HeadConfig,
    training: bool,
    reduction: str,
    mtp_weights: torch.Tensor | None,
) -> torch.Tensor:
    """Cross-entropy (mean, sum or per position (B, T)); MTP's weighted sum in training (#53)."""
    B, T = targets.shape
    logits = logits if part.ce_bf16 and training else logits.float()
    if mtp_weights is not None and training and reduction == "mean":
        return mtp_loss(logits, targets, mtp_weights)
    out = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction)
    return out.view(B, T) if reduction == "none" else out


def training_loss(
    head: CastedLinear,
    x: torch.Tensor,
    targets: torch.Tensor,
    part: HeadConfig,
    mtp_weights,
    prefix_table: torch.Tensor | None = None,
    prefix_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mean training loss of a softcapped head from the raw logits, through the named op
    `softcapped_ce` (`softcapped_prefix_ce` with #88's prefix table; a fused kernel may replace either:
    speedrun.perf); the same numbers as `loss(capped_logits(...), training=True, reduction="mean")`
    (plus `prefix.prefix_loss` on those logits)."""
    assert part.softcap > 0, "training_loss is the softcapped head's"
    raw = head_logits(head, x, part.fp8)
    cap = (part.softcap, part.softcap_divisor, part.softcap_offset, part.softcap_in_bf16, part.ce_bf16)
    if prefix_table is not None:
        return softcapped_prefix_ce(raw, targets, mtp_weights, prefix_table, prefix_weight, *cap)
    return softcapped_ce(raw, targets, mtp_weights, *cap)


@ops.plain_op("softcapped_ce")
def softcapped_ce(
    raw: torch.Tensor,
    targets: torch.Tensor,
    mtp_weights: torch.Tensor | None,
    cap: float,
    divisor: float,
    offset: float,
    cap_in_bf16: bool,
    ce_bf16: bool,
) -> torch.Tensor:
    """Raw logits (B, T, V) → the sigmoid softcap (in their dtype, or fp32) → the mean cross-entropy
    (on bf16 logits with `ce_bf16`), or MTP's weighted sum with `mtp_weights`."""
    z = raw if cap_in_bf16 else raw.float()
    z = softcap(z, cap, "sigmoid", divisor, offset)
    z = z if ce_bf16 else z.float()
    if mtp_weights is not None:
        return mtp_loss(z, targets, mtp_weights)
    return F.cross_entropy(z.view(-1, z.size(-1)), targets.reshape(-1))


@ops.plain_op("softcapped_prefix_ce")
def softcapped_prefix_ce(
    raw: torch.Tensor,
    targets: torch.Tensor,
    mtp_weights: torch.Tensor | None,
    table: torch.Tensor,
    weight: torch.Tensor,
    cap: float,
    divisor: float,
    offset: float,
    cap_in_bf16: bool,
    ce_bf16: bool,
) -> torch.Tensor:
    """`softcapped_ce` plus #88's prefix-token term on the same capped logits (prefix.prefix_loss)."""
    z = raw if cap_in_bf16 else raw.float()
    z = softcap(z, cap, "sigmoid", divisor, offset)
    z = z if ce_bf16 else z.float()
    if mtp_weights is not None:
        out = mtp_loss(z, targets, mtp_weights)
    else:
        out = F.cross_entropy(z.view(-1, z.size(-1)), targets.reshape(-1))
    return out + prefix.prefix_loss(z, targets, table, weight)


# Multi-token prediction (record #53, 2025-12-22, PR #178): in training, position t's logits are also
# scored against the tokens k = 1, 2, … after its target, and the loss is the weighted sum
# Σ_t Σ_k w_k·(logsumexp(z_t) − z_t[y_{t+k}]). The one head predicts them all; no extra parameters. The
# weights decay over training (#53: [1, 0.5, 0.25 → 0], then [1, 0.5 → 0], then [1]: the stage plan's
# `mtp=`), so the run ends on plain next-token prediction. Targets past a row's end count zero; within
# a packed row they run on across document boundaries, as in the record. Validation is plain
# cross-entropy.
#
# The weights live in a fixed-length buffer (trailing zeros for heads a stage dropped), written in place
# each step: a compiled forward sees new values, not a new graph.


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


def register_buffers(model: torch.nn.Module, cfg, vocab: int) -> None:
    """The loss's buffers on `model` (not saved), None where absent: #53's MTP weights, #88's prefix
    table and weight, #92's sweep and its start (P: `sampled_candidates`, 0 = the full softmax, written
    each step by the schedule), #350's canonical-token mask (built once here, before the clock)."""
    if cfg.head.mtp > 1:  # #53: the training loss weighs the next cfg.mtp tokens
        model.register_buffer("mtp_weights", torch.eye(cfg.head.mtp)[0], persistent=False)
    else:
        model.mtp_weights = None
    if cfg.head.prefix_loss_weight > 0:  # #88: the GPT-2 vocabulary's table, ids past the vocab dropped
        if torch.empty(0).is_meta:  # a model for counting (shapes only): no tokenizer files needed
            table = torch.full((vocab,), -1, dtype=torch.int64)
        else:
            table = prefix.gpt2_prefix_table(vocab)
        model.register_buffer(
            "prefix_table", table.masked_fill(table >= cfg.vocab_size, -1), persistent=False
        )
        model.register_buffer("prefix_weight", torch.tensor(cfg.head.prefix_loss_weight), persistent=False)
    else:
        model.prefix_weight = None
    model.sampled_candidates = 0
    if cfg.head.sampled_stride:  # #92: the negatives' sweep over the head's rows
        model.register_buffer(
            "sampled_sweep", sampled.sweep(vocab, cfg.head.sampled_stride), persistent=False
        )
        model.register_buffer("sampled_start", torch.zeros((), dtype=torch.int64), persistent=False)
    else:
        model.sampled_sweep = None
    if cfg.head.canonical_val_mask:  # #350: built once here, before the clock; not saved
        if torch.empty(0).is_meta:  # a model for counting (shapes only): the table's bits are never read
            mask = torch.empty(vocab, vocab // 8, dtype=torch.uint8)
        else:
            ranks = gpt2_tokenizer().encoding._mergeable_ranks
            mask = canonical.canonical_mask({b: r for b, r in ranks.items() if r < cfg.vocab_size}, vocab)
        model.register_buffer("canonical_mask", mask, persistent=False)
    else:
        model.canonical_mask = None
