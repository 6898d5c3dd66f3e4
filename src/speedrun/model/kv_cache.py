"""Cached decoding: `forward_cached(model, idx, cache)` gives the logits of the new positions `idx`
(B, n) after the tokens in `cache`, through the GPT's own `hidden` and `logits`; only each layer's
attention context differs (`Cached`: cached keys and values, under the forward's masks from the model's
`mask_specs`, cut to the new rows). Nothing here knows a model family."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from speedrun.model.attention import MaskSpec, document_ids, spec_dense_mask
from speedrun.model.contexts import near_keys

#: What decoding needs of a model, whatever its family: `cfg.n_layer`, `cfg.max_seq_len`,
#: `cfg.vocab_size`, `cfg.eot_id`; `mask_specs(tokens)`; `hidden(idx, contexts, start=, prev=)` (one
#: model/contexts.py context per layer; `prev` the `lookback` tokens before idx, 1 unless the model says
#: more); `logits(hidden)`; per block an `attn` (or None) with `paired`.
Model = torch.nn.Module


@dataclass
class KVCache:
    """Keys/values per attention layer (B, H, T, D) and the token ids seen so far (B, T)."""

    keys: dict[int, Tensor] = field(default_factory=dict)
    values: dict[int, Tensor] = field(default_factory=dict)
    tokens: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.tokens is None else self.tokens.size(1)


@dataclass
class Cached:
    """Decoding's attention context (model/contexts.py) for layer `layer`: new positions start.. attend
    to the cached keys and values and their own under `mask`; `docs` (B, T): every position's document."""

    cache: KVCache
    layer: int
    mask: Tensor
    start: int
    docs: Tensor

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The cached keys/values with the new ones after them, stored as projected (#49's offset reads
        the key before, so the attended keys are derived again from these)."""
        c = self.cache
        if self.layer in c.keys:
            k = torch.cat([c.keys[self.layer], k], dim=2)
            v = torch.cat([c.values[self.layer], v], dim=2)
        c.keys[self.layer], c.values[self.layer] = k, v
        return k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None, kernel: str = "auto") -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale)

    def near(self, window: int) -> Tensor:
        return near_keys(self.docs[:, self.start :], self.docs, self.start, window)


@torch.no_grad()
def forward_cached(model: Model, idx: Tensor, cache: KVCache) -> Tensor:
    """Logits (B, n, padded vocab) for the new tokens `idx` (B, n); appends them to `cache`."""
    cfg = model.cfg
    start = cache.length
    assert start + idx.size(1) <= cfg.max_seq_len, "callers keep within the context (generate, sample)"
    cache.tokens = idx if cache.tokens is None else torch.cat([cache.tokens, idx], dim=1)
    end, device = cache.tokens.size(1), idx.device
    specs = model.mask_specs(cache.tokens) or [MaskSpec()] * cfg.n_layer  # MaskSpec(): causal only
    paired = [b.attn is not None and b.attn.paired for b in model.blocks]  # #58: positions doubled
    built = {
        (id(s), p): spec_dense_mask(s, start * (1 + p), end * (1 + p), 0, end * (1 + p), device)
        for s, p in zip(specs, paired, strict=True)
    }
    docs = document_ids(cache.tokens, cfg.eot_id)
    masks = [built[(id(s), p)] for s, p in zip(specs, paired, strict=True)]
    contexts = [Cached(cache, i, mask, start, docs) for i, mask in enumerate(masks)]
    back = getattr(model, "lookback", 1)  # tokens the input reads back: smear's 1 (#34), #92's n-grams 2
    prev = cache.tokens[:, max(0, start - back) : start] if start > 0 else None
    return model.logits(model.hidden(idx, contexts, start=start, prev=prev))


def pick_next(
    logits: Tensor, vocab_size: int, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """Next token per row from (B, V) logits: argmax at temperature 0, else top-k sampling.
    Padding rows of the head (ids >= vocab_size) are never chosen."""
    logits = logits[:, :vocab_size].float()
    if temperature <= 0:
        return logits.argmax(dim=-1)
    # in fp64 and shifted so the likeliest logit is 0 before dividing: a tiny temperature (1e-300,
    # which fp32 rounds to 0) then gives 0 and -inf, i.e. greedy, instead of nan; else the same softmax
    logits = (logits.double() - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(
    model: Model,
    prompt: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[Tensor]:
    """Yield (B,) next tokens, one step at a time, after `prompt` (B, T), decoding from the KV cache
    (tests/model_refs.generate_uncached, the full forward every step, is its reference)."""
    steps = min(max_new_tokens, model.cfg.max_seq_len - prompt.size(1))
    cache = KVCache()
    logits = forward_cached(model, prompt, cache)[:, -1]
    for n in range(steps):
        nxt = pick_next(logits, model.cfg.vocab_size, temperature, top_k, generator)
        yield nxt
        if n + 1 < steps:
            logits = forward_cached(model, nxt[:, None], cache)[:, -1]
