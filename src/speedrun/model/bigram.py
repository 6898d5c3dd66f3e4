"""Bigram hash embedding (record #62, 2026-01-19, PR #201): each position also looks up a row for the
pair (previous token, token), hashed into `rows` buckets, and every layer adds its own share of it,
λ_i·b (λ init 0.1), to its input next to the x0 shortcut: a cheap two-token memory the attention no
longer has to build. The table starts at zero and is trained by Adam like the value embeddings (#65:
betas 0.75/0.95, LR x75, decay x5). The hash is the record's get_bigram_hash: in int32,
(36313·cur XOR 27191·prev) mod (rows − 1) with int32 wrap-around, the first position of a sequence the
reserved row rows − 1, which is also the second position's prev (the record overwrites token 0 with it
before hashing); documents packed in a row hash across their boundary, as the record does."""

from __future__ import annotations

import torch
from torch import nn

from speedrun.model.labels import label


def bigram_hash(
    idx: torch.Tensor, rows: int, prev: torch.Tensor | None = None, start: int = 0
) -> torch.Tensor:
    """Token ids (B, T) at positions start.. → bucket ids (B, T). Cached decoding (start > 0) passes
    `prev` (B, 1), the token at start − 1."""
    mod = rows - 1
    x = idx.to(torch.int32)
    if start == 0:  # get_bigram_hash: x[0] = mod, then x[1:] hashed with the overwritten x[:-1]
        seq = torch.cat([torch.full_like(x[:, :1], mod), x[:, 1:]], dim=1)
    else:
        seq = torch.cat([prev.to(torch.int32) if start > 1 else torch.full_like(x[:, :1], mod), x], dim=1)
    h = torch.bitwise_xor(36313 * seq[:, 1:], 27191 * seq[:, :-1]) % mod
    return torch.cat([seq[:, :1], h], dim=1) if start == 0 else h


class BigramEmbed(nn.Module):
    def __init__(self, rows: int, dim: int, n_layer: int):
        super().__init__()
        self.rows = rows
        self.embed = nn.Embedding(rows, dim)
        label(self.embed.weight, "bigram")
        self.lambdas = label(nn.Parameter(torch.full((n_layer,), 0.1)), "scalar")
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero, as the record (GPT._init_weights calls this again after its own init)."""
        nn.init.zeros_(self.embed.weight)

    def forward(self, idx: torch.Tensor, prev: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        """The bigram rows (B, T, C) of the tokens idx; each layer i adds lambdas[i] times this."""
        return self.embed(bigram_hash(idx, self.rows, prev, start))
