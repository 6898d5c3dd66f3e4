"""Where the records' `DistributedDataLoader` (10-10 … 12-08) reads, as a function of the step.

Each rank v keeps its own cursor: it starts a shard at `v·S` (S = G/R), reads S + 1 tokens, moves by G,
and moves to the next shard as soon as fewer than `G + 1 + margin` tokens remain (12-08: `>=`). Ranks can
thus change shard a step apart, but each rank's reads follow from the shard lengths alone: all cursors at
global batch b are a pure function of b, and only b needs saving to resume."""

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
