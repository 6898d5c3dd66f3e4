"""Dense references the model's parts are tested against (and benchmarks/bench_attention_memory.py measures):
written from the definitions, T × T where that is the plain way, kept out of the package that never calls
them."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from speedrun.model.kv_cache import pick_next


def packed_docs(cu_seqlens: Tensor, T: int) -> Tensor:
    """(T,) document index of every position of a packed row bounded by `cu_seqlens` (0 … T, padded)."""
    pos = torch.arange(T, device=cu_seqlens.device)
    return torch.bucketize(pos, cu_seqlens[1:].to(pos.dtype), right=True)


def visible(cu_seqlens: Tensor, T: int, window: int) -> Tensor:
    """(T, T) booleans: key s is at or before query t, in its document and (window > 0) t − s < window."""
    pos, doc = torch.arange(T, device=cu_seqlens.device), packed_docs(cu_seqlens, T)
    rel = pos[:, None] - pos[None, :]
    allowed = (rel >= 0) & (doc[:, None] == doc[None, :])
    return allowed & (rel < window) if window > 0 else allowed


def dense_reference(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, scale: float | None
) -> Tensor:
    """The T × T-mask definition every varlen attention tier is tested against (packed (T, H, D))."""
    mask = visible(cu_seqlens, q.size(0), window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=scale
    )
    return out.transpose(0, 1)


def dc_correction(
    y: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, scale: float, window: int,
    cu_seqlens: Tensor,
) -> Tensor:  # fmt: skip
    """#85's DC correction on one packed row (model/gpt2026/dc.py): y, q, k, v (T, H, D), w1, w2 (T, H),
    cu_seqlens (docs + 1,) → y plus the correction, in y's dtype (probabilities in fp32)."""
    valid = visible(cu_seqlens, q.size(0), window)
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * scale
    probs = scores.masked_fill(~valid, float("-inf")).softmax(dim=-1)
    mixed = torch.einsum("th,hts->ts", w1.float(), probs)
    corr = torch.einsum("ts,shd->thd", mixed, v.float()) * w2.float()[..., None]
    return (y.float() + corr).to(y.dtype)


def xsa_rewritten(y: Tensor, v: Tensor, alpha: Tensor) -> Tensor:
    """#86's form of #82's XSA (y, v (B, H, T, D), alpha (H,)): no normalized copy of v,
    (y·v)/max(‖v‖², 1e-8)·v, the same value as the normalize form since max(‖v‖, 1e-4)² = max(‖v‖², 1e-8)."""
    share = (y * v).sum(-1, keepdim=True) / v.square().sum(-1, keepdim=True).clamp_min(1e-8)
    return y - torch.tanh(alpha).type_as(y).view(1, -1, 1, 1) * share * v


@torch.no_grad()
def generate_uncached(model: torch.nn.Module, prompt: Tensor, max_new_tokens: int) -> Iterator[Tensor]:
    """Greedy (B,) next tokens after `prompt` (B, T) from the full forward over the whole sequence at every
    step: the reference KV-cached decoding (kv_cache.generate) is tested against."""
    seq = prompt
    for _ in range(min(max_new_tokens, model.cfg.max_seq_len - prompt.size(1))):
        nxt = pick_next(model(seq)[:, -1], model.cfg.vocab_size, 0.0, None, None)
        yield nxt
        seq = torch.cat([seq, nxt[:, None]], dim=1)
