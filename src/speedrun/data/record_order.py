"""Where the records' `DistributedDataLoader` (10-10 … 12-08) reads, as a function of the step.

In those records every rank keeps its own cursor: rank v starts a shard at `v·S` (S = G/R tokens, G the
global batch, R ranks), reads S + 1 tokens, moves by G, and moves on to the next shard (again at `v·S`,
wrapping after the last) as soon as its next position leaves fewer than `G + 1 + margin` tokens
(`pos + G + 1 > len`, 12-08: `pos + G + 1 >= len`). A rank with a larger v hits that test earlier, so
near a shard's end ranks can change shard a step apart, and the offset grows with every shard (on
fineweb's 10^8-token shards ranks 6 and 7 read 189 batches a shard, ranks 0-5 read 190).

Rank v's reads per shard follow from the shard's length alone, so the cursors of all R ranks at
global batch b are a pure function of b: nothing but b needs saving to resume.
"""

from __future__ import annotations

import numpy as np

from speedrun.errors import DataError


class RankCursors:
    """Shard and start of each of the record's R per-rank slices of global batch `b`."""

    def __init__(self, lengths: list[int], global_tokens: int, ranks: int, margin: int = 0):
        self.ranks, self.slice = ranks, global_tokens // ranks
        g = global_tokens
        counts = np.zeros((ranks, len(lengths)), dtype=np.int64)
        for i, n in enumerate(lengths):
            if n < g + 1:  # the records assert every shard holds G + 1 tokens; ours skips smaller ones
                continue
            for v in range(ranks):
                # the first read at v·S is unconditional; read j >= 1 needs j·G + v·S + G + 1 + margin <= n
                counts[v, i] = 1 + max(0, (n - 1 - margin - g - v * self.slice) // g)
        if not counts.any():
            raise DataError(f"no shard holds one global batch of {g} + 1 tokens ({max(lengths)} at most)")
        self.counts = counts
        self.ends = np.cumsum(counts, axis=1)  # batches of rank v read before the end of shard i
        self.global_tokens = g

    def locate(self, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, start, epoch) per rank for global batch `batch` (0-based)."""
        shards = np.empty(self.ranks, dtype=np.int64)
        starts = np.empty(self.ranks, dtype=np.int64)
        epochs = np.empty(self.ranks, dtype=np.int64)
        for v in range(self.ranks):
            epochs[v], rest = divmod(batch, int(self.ends[v, -1]))
            i = int(np.searchsorted(self.ends[v], rest, side="right"))
            before = int(self.ends[v, i - 1]) if i else 0
            shards[v] = i
            starts[v] = (rest - before) * self.global_tokens + v * self.slice
        return shards, starts, epochs
