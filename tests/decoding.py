"""Cached decoding against the full forward, the one check every model part that attends repeats: the
prompt's first `prefill` tokens in one cached call, then one token a call (speedrun.model.kv_cache)."""

from __future__ import annotations

import torch
from torch import Tensor

from speedrun.model.kv_cache import KVCache, forward_cached


def cached_logits(model: torch.nn.Module, idx: Tensor, prefill: int) -> Tensor:
    """The logits of every position of `idx` (B, T) as cached decoding computes them."""
    cache = KVCache()
    pieces = [forward_cached(model, idx[:, :prefill], cache)]
    pieces += [forward_cached(model, idx[:, t : t + 1], cache) for t in range(prefill, idx.size(1))]
    return torch.cat(pieces, dim=1)


@torch.no_grad()
def assert_cached_decoding_is_the_forward(
    model: torch.nn.Module, idx: Tensor, prefill: int, tol: float = 1e-4
) -> Tensor:
    """Cached decoding equals `model(idx)` at every position (rtol = atol = tol); returns the full logits."""
    full = model(idx)
    torch.testing.assert_close(cached_logits(model, idx, prefill), full, rtol=tol, atol=tol)
    return full
