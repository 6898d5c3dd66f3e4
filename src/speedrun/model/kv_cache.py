"""Cached decoding: run a trained GPT one token at a time, reusing every earlier key and value.

`forward_cached(model, idx, cache)` computes the logits of the new positions `idx` (B, n) given the
tokens already in `cache`. It runs the GPT's own `hidden` and `logits` (embeddings, value residual /
value embeddings, x0 shortcut, U-Net skips, MLP-only layers, head) and its attentions' own
`project`/`output`; only the attention call differs: keys and values of earlier positions come from
the cache, under the masks the forward uses (`attention.layer_specs`: causal, document, long/short
sliding window, block listing), cut to the new rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from speedrun.model.attention import MaskSpec, document_ids, spec_dense_mask

#: What decoding needs of a model, whatever its family (gpt2024 or gpt2026): `cfg.n_layer`,
#: `cfg.max_seq_len`, `cfg.vocab_size`; `mask_specs(tokens)`; `hidden(idx, start=, attend_fns=, prev=)`;
#: `logits(hidden)`; and per block an `attn` (or None) with `project`, `attended_keys`, `output`,
#: `paired` and `scale`.
Model = torch.nn.Module
#: (attention module, normed input, other v) → (output, unmixed v)
AttendFn = Callable[[torch.nn.Module, Tensor, Tensor | None], tuple[Tensor, Tensor]]


@dataclass
class KVCache:
    """Keys/values per attention layer (B, H, T, D) and the token ids seen so far (B, T)."""

    keys: dict[int, Tensor] = field(default_factory=dict)
    values: dict[int, Tensor] = field(default_factory=dict)
    tokens: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.tokens is None else self.tokens.size(1)


def _attend_cached(
    attn: torch.nn.Module,
    layer: int,
    x: Tensor,
    other_v: Tensor | None,
    mask: Tensor,
    cache: KVCache,
    start: int,
    dyn=None,
    eot_id: int = -1,
) -> tuple[Tensor, Tensor]:
    """Attention.forward for new positions, with earlier keys/values from the cache."""
    q, k, v, raw_v = attn.project(x, other_v, start)
    if layer in cache.keys:
        k = torch.cat([cache.keys[layer], k], dim=2)
        v = torch.cat([cache.values[layer], v], dim=2)
    cache.keys[layer], cache.values[layer] = k, v  # as projected: #49's offset reads the key before
    y = F.scaled_dot_product_attention(q, attn.attended_keys(k), v, attn_mask=mask, scale=attn.scale)
    if dyn is not None:  # gpt2026's #85 per-token gates (XSA among them, and DC's weights)
        if "dc1" in dyn:  # the correction's rows of the new positions, over every cached key
            from speedrun.model.gpt2026.dc import DC_WINDOW, dc_valid

            docs = document_ids(cache.tokens, eot_id)
            valid = dc_valid(docs[:, start:], docs, start, DC_WINDOW)
            y = attn.dc(y, q, attn.attended_keys(k), v, x, dyn, valid)
        return attn.output(y, x, v[:, :, -q.size(2) :], dyn), raw_v
    if getattr(attn, "xsa", None) is not None:  # gpt2026's #82 XSA reads the new positions' values
        return attn.output(y, x, v[:, :, -q.size(2) :]), raw_v
    return attn.output(y, x), raw_v


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

    def cached(i: int) -> AttendFn:
        mask = built[(id(specs[i]), paired[i])]
        return lambda attn, x, other_v, dyn=None: _attend_cached(
            attn, i, x, other_v, mask, cache, start, dyn, cfg.eot_id
        )

    prev = cache.tokens[:, start - 1 : start] if start > 0 else None  # smear's look-back (#34)
    hidden = model.hidden(idx, start=start, attend_fns=[cached(i) for i in range(cfg.n_layer)], prev=prev)
    return model.logits(hidden)


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
    use_cache: bool = True,
) -> Iterator[Tensor]:
    """Yield (B,) next tokens, one step at a time, after `prompt` (B, T). `use_cache=False` runs the full
    forward over the whole sequence every step (the reference the cache is tested against)."""
    vocab = model.cfg.vocab_size
    steps = min(max_new_tokens, model.cfg.max_seq_len - prompt.size(1))
    if use_cache:
        cache = KVCache()
        logits = forward_cached(model, prompt, cache)[:, -1]
        for n in range(steps):
            nxt = pick_next(logits, vocab, temperature, top_k, generator)
            yield nxt
            if n + 1 < steps:
                logits = forward_cached(model, nxt[:, None], cache)[:, -1]
        return
    seq = prompt
    for _ in range(steps):
        nxt = pick_next(model(seq)[:, -1], vocab, temperature, top_k, generator)
        yield nxt
        seq = torch.cat([seq, nxt[:, None]], dim=1)
