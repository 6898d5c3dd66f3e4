"""What the gpt2026 blocks read besides the residual stream: #34's smear of the token embeddings and #62's
bigram hash embedding (λ_i·b added to each layer's input); the token and value-embedding tables (#45's
layout, #63's untied tables: one row per token, mixed into v of their layers) are layers.embedding's.
Each part labels its parameters."""

from __future__ import annotations

import torch
from torch import nn

from speedrun.model.labels import label, label_linear
from speedrun.model.layers import CastedLinear

# Smear (record #34, 2025-09-18, PR #130): each token's embedding takes in a gated share of the
# previous token's, x[t] += λ·sigmoid(W·x[t, :k])·x[t-1] for t >= 1, before the embedding norm. W (1, k)
# (k = 12 in the record) starts at zero and is trained by Muon like the block matrices; λ (a scalar,
# trained by Adam) starts at zero, so the model starts without smear. A cheap one-token look-back: the
# first layer no longer needs attention for bigrams (#35 drops it). The record smears across the
# documents packed in a row (a document's first token takes from the last token of the one before).


class Smear(nn.Module):
    def __init__(self, dims: int):
        super().__init__()
        self.gate = label_linear(CastedLinear(dims, 1, bias=False), "smear_gate")
        self.lamb = label(nn.Parameter(torch.zeros(1)), "scalar")
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero, as the record (GPT._init_weights calls this again after its own init)."""
        nn.init.zeros_(self.gate.weight)

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C) token embeddings → smeared; `prev` (B, 1, C): the embedding of the token before
        x[:, 0] (cached decoding), None when x starts the sequence (its first token is left alone)."""
        if prev is not None:
            return self(torch.cat([prev, x], dim=1))[:, 1:]
        k = self.gate.in_features
        g = self.lamb * torch.sigmoid(self.gate(x[:, 1:, :k]))
        return torch.cat([x[:, :1], x[:, 1:] + g * x[:, :-1]], dim=1)


# Bigram hash embedding (record #62, 2026-01-19, PR #201): each position also looks up a row for the
# pair (previous token, token), hashed into `rows` buckets, and every layer adds its own share of it,
# λ_i·b (λ init 0.1), to its input next to the x0 shortcut: a cheap two-token memory the attention no
# longer has to build. The table starts at zero and is trained by Adam like the value embeddings (#65:
# betas 0.75/0.95, LR x75, decay x5). The hash is the record's get_bigram_hash: in int32,
# (36313·cur XOR 27191·prev) mod (rows − 1) with int32 wrap-around, the first position of a sequence the
# reserved row rows − 1, which is also the second position's prev (the record overwrites token 0 with it
# before hashing); documents packed in a row hash across their boundary, as the record does.


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


SHARE = (0.1, "scalar")  # #62's bigram λ per layer: its start and label


class BigramEmbed(nn.Module):
    def __init__(
        self,
        rows: int,
        dim: int,
        n_layer: int,
        width: int | None = None,
        share: tuple[float, str] | None = SHARE,
    ):
        """`width`: the stream's width where the rows are narrower (#89's script: 192 of 768); `share`: each
        layer's λ_i (its start and label; `bigram_share`), None where #85's gates give them per token."""
        super().__init__()
        self.rows = rows
        self.pad = (width or dim) - dim  # #89's script: rows of 192 dims added to x[..., :192]
        self.embed = nn.Embedding(rows, dim)
        label(self.embed.weight, "bigram")
        self.lambdas = label(nn.Parameter(torch.full((n_layer,), share[0])), share[1]) if share else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero, as the record (GPT._init_weights calls this again after its own init)."""
        nn.init.zeros_(self.embed.weight)

    def forward(self, idx: torch.Tensor, prev: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        """The bigram rows (B, T, C) of the tokens idx; each layer i adds lambdas[i] times this."""
        return self.widen(self.embed(bigram_hash(idx, self.rows, prev, start)))

    def widen(self, rows: torch.Tensor) -> torch.Tensor:
        """Narrow rows (B, T, dim) zero-padded to the stream's width: x + pad(b) is x[..., :dim] += b."""
        return torch.nn.functional.pad(rows, (0, self.pad)) if self.pad else rows


def bigram_share(residual_form: str, gated: bool) -> tuple[float, str] | None:
    """The layers' bigram λ: from 0.1 (#62), from 0.05 and trained with the lambdas in #77's form, none
    under #85's gate network (its gates are the shares)."""
    return None if gated else (0.05, "lambda") if residual_form == "sublayer" else SHARE
