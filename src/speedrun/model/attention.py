"""Attention masks and the attention call, kept apart from the model so backends can be swapped.

One mask definition (causal, optionally restricted to the current document) feeds every backend.
Today the backend is `scaled_dot_product_attention`: the fused causal kernel when no document mask
is needed, otherwise a dense boolean mask. FlexAttention block masks plug in here later.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_ids(tokens: torch.Tensor, eot_id: int) -> torch.Tensor:
    """Document index of every position: a new document starts at each end-of-text token.

    tokens: (B, T) integer ids. Returns (B, T) int32, counting from 0 at the first document (a leading
    partial document, before the first end-of-text token, is document 0 as well).
    """
    return (tokens == eot_id).cumsum(dim=-1, dtype=torch.int32)


def dense_mask(doc_ids: torch.Tensor | None, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean (B or 1, 1, T, T) mask, True where query i may attend to key j (j <= i, same document)."""
    if doc_ids is None:
        return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (causal & same_doc)[:, None]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    """Causal attention on (B, H, T, D) tensors; `mask` is a dense_mask() result or None for plain causal."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
