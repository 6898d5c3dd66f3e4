"""Partial key offset (record #49, 2025-12-14, PR #169): on the long-window layers, the key dimensions
that rotary leaves stationary (the zero-frequency half of each rotary half: dims D/4 … D/2 and
3D/4 … D of a head of D) are taken from the previous token's key. A query can then match "the token
after an X" in one layer — a cheap induction head. The record shifts after QK-norm and rotary, over
the whole packed row (across document boundaries too); the first position keeps its own key.

The shift is a function of the whole key sequence, so it is applied where the keys are attended
(forward and cached decoding alike, model/kv_cache.py keeps the unshifted keys)."""

from __future__ import annotations

import torch


def offset_keys(k: torch.Tensor, seq_dim: int = -2) -> torch.Tensor:
    """k (…, T, …, D) with its stationary dims shifted one position forward along `seq_dim` (#49):
    out[t] = k[t − 1] on dims D/4:D/2 and 3D/4:D for t >= 1, k elsewhere. Out of place."""
    d = k.size(-1)
    shifted = torch.cat([k.narrow(seq_dim, 0, 1), k.narrow(seq_dim, 0, k.size(seq_dim) - 1)], dim=seq_dim)
    quarter = torch.arange(d, device=k.device) % (d // 2) >= d // 4  # the stationary dims
    return torch.where(quarter, shifted, k)
