"""#83's sign trick on the bigram hash embedding (record #83, 2026-05-20, PR #299).

Many bigrams share a hash row (#62). The record multiplies each looked-up row by a fixed ±1 vector
chosen by a second, independent index, (prev XOR cur) mod R (R = 8,192 rows, a buffer drawn once as
randn(R, dim).sign() in bf16 and broadcast from rank 0), so bigrams that collide in the hash table
mostly read it through different sign patterns and interfere less. Position 0 of a sequence uses sign
row 0 (the record's sign_idx starts as zeros). The index reads the raw token ids, across packed
documents, as the record does. Nothing is learned: the table is a buffer, saved with the model.
"""

from __future__ import annotations

import torch

from speedrun.model.gpt2026.embeddings import SHARE, BigramEmbed, bigram_hash


def sign_index(
    idx: torch.Tensor, rows: int, prev: torch.Tensor | None = None, start: int = 0
) -> torch.Tensor:
    """Token ids (B, T) at positions start.. → sign-table rows (B, T); cached decoding (start > 0)
    passes `prev` (B, 1), the token at start − 1."""
    if start > 0:
        return torch.bitwise_xor(torch.cat([prev, idx], dim=1)[:, :-1], idx) % rows
    out = torch.zeros_like(idx)
    out[:, 1:] = torch.bitwise_xor(idx[:, :-1], idx[:, 1:]) % rows
    return out


class SignedBigramEmbed(BigramEmbed):
    """#62's bigram embedding whose rows are multiplied by #83's ±1 sign rows."""

    def __init__(
        self, rows: int, dim: int, n_layer: int, sign_rows: int, width: int | None = None, share=SHARE
    ):
        super().__init__(rows, dim, n_layer, width, share)
        # drawn after the table, as the record's __init__ (bigram_embed, then its sign table)
        self.register_buffer("sign_table", torch.randn(sign_rows, dim).sign().to(torch.bfloat16))

    def forward(self, idx: torch.Tensor, prev: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        signs = self.sign_table[sign_index(idx, self.sign_table.size(0), prev, start)]
        rows = self.embed(bigram_hash(idx, self.rows, prev, start))
        return self.widen(rows * signs)
