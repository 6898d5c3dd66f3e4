"""Where an attention layer's call differs between the forward, packed documents and decoding.

A model family writes its attention layer once (project → attended keys → kernel → corrections →
output); what changes with the way it is called comes from a context: the rotary position of the first
query (`start`), the keys and values attended (`keys_values`: a KV cache prepends and stores them), the
kernel call (`attend`) and which keys lie near a query in its document (`near`, #85's windowed DC
correction). `Masked` is the forward's; `kv_cache.Cached` decoding's; `gpt2026.windows.Packed` the
variable-length kernels'. Contexts are built per forward, one per layer (or shared by layers alike)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from speedrun.model.attention import AttentionMask, attend, document_ids


class Context(Protocol):
    start: int

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float | None, kernel: str = "auto"
    ) -> Tensor: ...

    def near(self, window: int) -> Tensor: ...


def near_keys(doc_q: Tensor, doc_k: Tensor, start: int, window: int) -> Tensor:
    """doc_q (B, Tq) of positions start.., doc_k (B, Tk) of positions 0.. → (B, Tq, Tk): key s is in
    (t − window, t] and in query t's document."""
    pos_q = torch.arange(start, start + doc_q.size(1), device=doc_q.device)
    rel = pos_q[:, None] - torch.arange(doc_k.size(1), device=doc_q.device)[None, :]
    return (rel >= 0) & (rel < window) & (doc_q[:, :, None] == doc_k[:, None, :])


class Masked:
    """The forward: every position of the input attends under `mask` (None: plain causal; a dense mask,
    a MaskSpec or a BlockMask); `tokens` (B, T) and `eot_id` give the documents `near` reads."""

    start = 0

    def __init__(self, mask: AttentionMask = None, tokens: Tensor | None = None, eot_id: int = -1):
        self.mask, self.tokens, self.eot_id = mask, tokens, eot_id

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None, kernel: str = "auto") -> Tensor:
        return attend(q, k, v, self.mask, scale, kernel)

    def near(self, window: int) -> Tensor:
        assert self.tokens is not None, "a model whose layers read `near` passes its tokens"
        docs = document_ids(self.tokens, self.eot_id)
        return near_keys(docs, docs, 0, window)


#: plain causal attention over the whole input
CAUSAL = Masked()
