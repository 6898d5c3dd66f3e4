"""What the gpt2026 blocks read besides the residual stream: token embeddings with #34's smear, value
embeddings (#45's ends-late, #63's untied tables; one row per token, mixed into v of their layers) and
#62's bigram hash embedding (λ_i·b added to each layer's input). Smear and bigram live in model/smear.py
and model/bigram.py until the gpt2024 GPT stops using them; here they are built and labelled."""

from __future__ import annotations

from torch import nn

from speedrun.model.bigram import BigramEmbed
from speedrun.model.labels import label
from speedrun.model.smear import Smear


def token_embedding(rows: int, dim: int) -> nn.Embedding:
    emb = nn.Embedding(rows, dim)
    label(emb.weight, "embed")
    return emb


def value_embeddings(tables: int, rows: int, dim: int) -> nn.ModuleList | None:
    """One table per distinct index of the config's `value_embeds` list (None without any)."""
    embeds = nn.ModuleList(nn.Embedding(rows, dim) for _ in range(tables))
    for emb in embeds:
        label(emb.weight, "value_embed")
    return embeds or None


def smear(dims: int) -> Smear:
    """#34: x[t] += λ·sigmoid(W·x[t, :dims])·x[t-1] before the embedding norm."""
    s = Smear(dims)
    label(s.gate.weight, "smear_gate")
    label(s.lamb, "scalar")
    return s


def bigram(rows: int, dim: int, n_layer: int) -> BigramEmbed:
    """#62: a hashed (previous, current) token table; layer i adds lambdas[i]·b."""
    b = BigramEmbed(rows, dim, n_layer)
    label(b.embed.weight, "bigram")
    label(b.lambdas, "scalar")
    return b
