"""#92's hashed n-gram embedding (record #92 ANVIL2, 2026-08-30, PR #360; config/gpt2026/ngram.py).

Each position t reads two rows of one table of V rows: a bigram row from the first half (a hash of
x[t-1], x[t]) and a trigram row from the second half (a hash of x[t-2], x[t-1], x[t]). Each row is
multiplied by a ±1 row of a shared pool (#83's sign trick) drawn by a second, independent hash of the
same tokens, and the two signed rows are summed: the one input #62's bigram rows fed, which the layers'
bigram shares (or #85's gates) scale and add to the stream's first `dim` dims.

The hashes are the record's (track_1_short/ngram_table.py, perf/kernels/ngram_embed.py), in int32 with
wrap-around, over the sequence of each row of `idx` (the record's one packed row), across documents:

    half = V/2, mb = half − 1, mt = V − half − 1, R = sign rows
    bigram row  b[0] = mb;  b[1] = (36313·x[1] ^ 27191·mb) % mb;  b[t] = (36313·x[t] ^ 27191·x[t-1]) % mb
    trigram row g[0] = g[1] = half + mt;  g[t] = (17351·x[t] ^ 60961·x[t-1] ^ 45259·x[t-2]) % mt + half
    bigram sign  (30011·x[t-1] ^ 48271·x[t]) & (R − 1), row 0 at t = 0
    trigram sign (26801·x[t-2] ^ 39779·x[t-1] ^ 58699·x[t]) & (R − 1), row 0 at t < 2

(the bigram row hash at t = 1 reads the reserved id as its previous token, as the record's in-place hash
does; the sign hashes read the tokens themselves). The products of ±1 rows are exact; the sum is
rounded once to the table's dtype, as the record's kernel does. The table starts at zero.

Where the rows come from is the part's own table (one process, or a run that keeps
the whole table), or the rows a row-sharded table pulled for this step (optim/row_shard.py) — the pull
happens around the model, before the forward, so the model itself does no communication. Cached
decoding gives the part the two tokens before the new ones (the model's `lookback`, model/kv_cache.py).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from speedrun import ops
from speedrun.model.labels import label

BIGRAM_ROW_MULS = (36313, 27191)  # x[t], x[t-1]
TRIGRAM_ROW_MULS = (17351, 60961, 45259)  # x[t], x[t-1], x[t-2]
BIGRAM_SIGN_MULS = (48271, 30011)  # x[t], x[t-1]
TRIGRAM_SIGN_MULS = (58699, 39779, 26801)  # x[t], x[t-1], x[t-2]


def ngram_rows(idx: Tensor, rows: int) -> Tensor:
    """Token ids (B, T) → table rows (B, 2T) int64: [:, :T] the bigram rows, [:, T:] the trigram rows."""
    x = idx.to(torch.int32)  # the products wrap in int32, as the record's
    (b0, b1), (t0, t1, t2) = BIGRAM_ROW_MULS, TRIGRAM_ROW_MULS
    half = rows // 2
    mb, mt = half - 1, rows - half - 1
    prev = torch.cat([torch.full_like(x[:, :1], mb), x[:, 1:-1]], dim=1)  # b[0] = mb replaces x[0]
    bigram = torch.cat([torch.full_like(x[:, :1], mb), torch.bitwise_xor(b0 * x[:, 1:], b1 * prev) % mb], 1)
    tri = torch.bitwise_xor(torch.bitwise_xor(t0 * x[:, 2:], t1 * x[:, 1:-1]), t2 * x[:, :-2]) % mt
    reserved = torch.full_like(x[:, :2], half + mt)[:, : x.size(1)]
    return torch.cat([bigram, reserved, tri + half], dim=1).long()


def ngram_signs(idx: Tensor, sign_rows: int) -> tuple[Tensor, Tensor]:
    """Token ids (B, T) → the sign-pool rows (B, T) of the bigram and the trigram channel."""
    x, mask = idx.to(torch.int32), sign_rows - 1
    (b0, b1), (t0, t1, t2) = BIGRAM_SIGN_MULS, TRIGRAM_SIGN_MULS
    bigram, trigram = torch.zeros_like(x), torch.zeros_like(x)
    bigram[:, 1:] = torch.bitwise_xor(b1 * x[:, :-1], b0 * x[:, 1:]) & mask
    trigram[:, 2:] = (
        torch.bitwise_xor(torch.bitwise_xor(t2 * x[:, :-2], t1 * x[:, 1:-1]), t0 * x[:, 2:]) & mask
    )
    return bigram.long(), trigram.long()


class NgramEmbed(nn.Module):
    """#92's n-gram rows summed into one (B, T, width) input; `lambdas` the layers' shares as #62's."""

    def __init__(
        self,
        rows: int,
        dim: int,
        n_layer: int,
        sign_rows: int,
        width: int | None = None,
        share: tuple[float, str] | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        self.rows, self.dim = rows, dim
        self.pad = (width or dim) - dim
        self.table = label(nn.Parameter(torch.zeros(rows, dim, dtype=dtype)), "ngram")
        self.lambdas = label(nn.Parameter(torch.full((n_layer,), share[0])), share[1]) if share else None
        # drawn as the record's GPT.init_misc: randn(pool, dim).sign() in bf16 (a buffer, saved)
        self.register_buffer("sign_pool", torch.randn(sign_rows, dim).sign().to(torch.bfloat16))
        self.pulled = None  # the rows a sharded table pulled for this forward (optim/row_shard.py)
        self.sharded = False  # the table holds only this process's rows (optim/row_shard.py `shard_part`)

    def reset_parameters(self) -> None:
        """Zero, as the record."""
        nn.init.zeros_(self.table)

    def forward(self, idx: Tensor, prev: Tensor | None = None, start: int = 0) -> Tensor:
        """The summed rows (B, T, width) of tokens idx at positions start..; cached decoding passes the
        tokens before them, `prev` (B, min(start, 2)) (the model's `lookback`)."""
        if start > 0:  # positions >= 2 of [prev, idx] hash as in the whole sequence; from 0 it is the whole
            assert prev is not None and prev.size(1) == min(start, 2), "decoding passes the 2 tokens before"
            return self(torch.cat([prev, idx], dim=1))[:, prev.size(1) :]
        ids = ngram_rows(idx, self.rows)
        assert self.pulled is not None or not self.sharded, "a sharded table reads the rows pulled for it"
        if self.pulled is not None:  # the pulled rows: where each id sits among them (Pulled.rows' index)
            source, slots = self.pulled.cache, torch.searchsorted(self.pulled.want, ids)
        else:
            source, slots = self.table, ids
        sb, st = ngram_signs(idx, self.sign_pool.size(0))
        out = ngram_embed(source, slots, sb, st, self.sign_pool)
        return nn.functional.pad(out, (0, self.pad)) if self.pad else out


@ops.plain_op("ngram_embed")
def ngram_embed(source: Tensor, slots: Tensor, sb: Tensor, st: Tensor, pool: Tensor) -> Tensor:
    """Rows `slots` (B, 2T) of `source` (R, d) → (B, T, d): the bigram rows [:, :T] times their sign rows
    pool[sb] plus the trigram rows [:, T:] times pool[st], summed in fp32 and rounded once to the rows'
    dtype. The gradient reaches `source` as a scatter-add of each row's share (rows repeat)."""
    T = sb.size(1)
    rows = nn.functional.embedding(slots, source)
    acc = torch.promote_types(rows.dtype, torch.float32)  # ±1 products exact, one rounding
    pool = pool.to(acc)
    return (rows[:, :T].to(acc) * pool[sb] + rows[:, T:].to(acc) * pool[st]).to(rows.dtype)


def ngram_part(cfg, share: tuple[float, str] | None) -> NgramEmbed:
    """The model's n-gram part from `[model.ngram]` (a Gpt2026Config), its layers' shares `share`."""
    p = cfg.ngram
    dtype = torch.bfloat16 if p.dtype == "bf16" else torch.float32
    return NgramEmbed(p.rows, p.dim or cfg.n_embd, cfg.n_layer, p.sign_rows, cfg.n_embd, share, dtype)
