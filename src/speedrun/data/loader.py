"""The token loader: every optimizer step sees the same tokens on 1, 2 or 8 processes.

A global batch is `global / micro` chunks of `micro + 1` tokens; rank r's k-th micro-step gets chunk
`k * world_size + r`. Where a batch lies is planned from the stream alone: a batch that does not fit in
the rest of a shard moves to the next (looping); with `align_to_bos` each chunk starts at a BOS. The
records' data-order switches (`docs/recipes.md`, Data): `end_margin` (12-08), `rank_cursors`
(10-10 … 12-08, `record_order.py`) and `repeat_first_batch` (10-10 … 11-10).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from threading import Lock

import numpy as np
import torch

from speedrun.data.device_feed import DeviceFeed
from speedrun.data.record_order import RankCursors
from speedrun.data.shards import (
    ShardFile,
    bos_positions,
    check_document_starts,
    check_token_range,
    read_header,
    read_shard,
    shard_fingerprint,
)
from speedrun.errors import ConfigError, DataError


def discard(future: Future | None) -> None:
    """Cancel or wait out a prefetch that will not be used; its error, if any, goes with it."""
    if future is not None:
        future.cancel()
        with contextlib.suppress(Exception):
            future.result()


@dataclass(frozen=True)
class _Step:
    """Where one global batch lies: shard, the cursor it was planned from (rank cursors: the batch index),
    chunk starts and each chunk's shard (which differs from `shard` only with rank cursors)."""

    shard: int
    pos: int
    starts: np.ndarray
    end: int
    wraps: int
    shards: np.ndarray


def _assert_split(total: int, micro_batch_tokens: int, seq_len: int, rank: int, world_size: int) -> None:
    """The batch rule is the caller's (run_data.micro_batch_tokens validates it once, at set-up)."""
    assert micro_batch_tokens % seq_len == 0 and 0 <= rank < world_size, (micro_batch_tokens, seq_len, rank)
    assert total > 0 and total % (world_size * micro_batch_tokens) == 0, (
        total,
        world_size,
        micro_batch_tokens,
    )


def _to_batch(chunk: np.ndarray, seq_len: int, vocab_size: int | None, path: Path, start: int):
    """inputs/targets (B, T) int64 host tensors from `micro + 1` tokens, ids range-checked."""
    if vocab_size is not None:
        check_token_range(chunk, vocab_size, path, start)
    x = torch.from_numpy(chunk[:-1].astype(np.int64)).view(-1, seq_len)
    y = torch.from_numpy(chunk[1:].astype(np.int64)).view(-1, seq_len)
    return x, y


class ShardReader:
    """What both loaders share: the shard files and their maps, fingerprints, the saved-state checks,
    and the optional prefetch thread (on CUDA by default)."""

    def __init__(self, files: list[Path], device: str | torch.device, prefetch: bool | None):
        self.files = [Path(f) for f in files]
        assert self.files, "run_data passes the shards meta.json lists (load_meta: never none)"
        self._lengths = [read_header(f) for f in self.files]
        self._maps: dict[int, ShardFile] = {}
        self._fingerprint: list[str] | None = None
        self.last_wait_s = self.total_wait_s = 0.0  # what the last next_batch() waited, and all of them
        self._epoch = 0
        self.device = torch.device(device)
        use_thread = self.device.type == "cuda" if prefetch is None else prefetch
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="speedrun-data") if use_thread else None
        )
        self._future: Future | None = None

    def _tokens(self, i: int) -> ShardFile:
        if i not in self._maps:
            self._maps[i] = read_shard(self.files[i])
        return self._maps[i]

    @property
    def epoch(self) -> int:
        """How many times the loader has wrapped around to the first shard."""
        return self._epoch

    def fingerprint(self) -> list[str]:
        """Per shard, its token count and a hash of its first tokens: names alone do not tell a folder
        prepared again (other text, another BPE under the same name) from the one a checkpoint saw."""
        if self._fingerprint is None:
            self._fingerprint = [shard_fingerprint(f) for f in self.files]
        return self._fingerprint

    def _check_saved(self, state: dict) -> None:
        """What a saved state must agree on: the shards' names and contents, a position inside them."""
        names = [f.name for f in self.files]
        if state.get("files") != names:
            raise DataError(f"loader state was saved for shards {state.get('files')}, not {names}")
        saved = state.get("fingerprint")  # absent in checkpoints from before it was recorded
        if saved is not None and saved != self.fingerprint():
            raise DataError(
                f"the shards in {self.files[0].parent} changed since the checkpoint was saved (prepared "
                "again from other text or with another tokenizer?); resume needs the data the run started on"
            )
        if (
            not 0 <= state["shard"] < len(self.files)
            or not 0 <= state["pos"] <= self._lengths[state["shard"]]
        ):
            raise DataError(f"loader state position {state['shard']}:{state['pos']} is outside the shards")

    def _drain(self) -> None:
        self._future = discard(self._future)

    def close(self) -> None:
        """Stop the prefetch thread."""
        self._drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class TokenLoader(ShardReader):
    """World-size-invariant training batches from `.bin` shards (see the module docstring)."""

    def __init__(
        self,
        files: list[Path],
        global_batch_tokens: int,
        micro_batch_tokens: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        align_to_bos: bool = False,
        bos_id: int | None = None,
        vocab_size: int | None = None,
        device: str | torch.device = "cpu",
        loop: bool = True,
        prefetch: bool | None = None,
        rank_cursors: int = 0,
        end_margin: int = 0,
        repeat_first_batch: bool = False,
    ):
        _assert_split(global_batch_tokens, micro_batch_tokens, seq_len, rank, world_size)
        assert bos_id is not None or not align_to_bos, "align_to_bos needs bos_id"
        super().__init__(files, device, prefetch)
        self.global_batch_tokens = global_batch_tokens
        self.micro_batch_tokens = micro_batch_tokens
        self.seq_len = seq_len
        self.rank, self.world_size = rank, world_size
        self.align_to_bos, self.bos_id = align_to_bos, bos_id
        self.vocab_size = vocab_size
        self.loop = loop
        self.accumulation_steps = global_batch_tokens // (world_size * micro_batch_tokens)
        self.n_chunks = global_batch_tokens // micro_batch_tokens
        self.end_margin, self.repeat_first_batch = end_margin, repeat_first_batch
        # The record's ranks, as many as whole chunks allow (8 for the records' own batch sizes).
        self.rank_cursors = math.gcd(rank_cursors, self.n_chunks) if rank_cursors else 0
        if self.rank_cursors and align_to_bos:
            raise ConfigError("rank_cursors and align_to_bos do not combine (no record does both)")
        ranks = self.rank_cursors
        self._cursors = RankCursors(self._lengths, global_batch_tokens, ranks, end_margin) if ranks else None
        self._bos: tuple[int, np.ndarray] | None = None
        self._plan_cache: _Step | None = None
        self._lock = Lock()  # the prefetch thread and the caller share the caches above
        # State = where the next micro-batch of this rank comes from; only ever advanced by next_batch.
        self._shard, self._pos, self._micro = 0, 0, 0
        self._batch, self._repeat = 0, repeat_first_batch  # batches done; batch 0 still to repeat
        if self._cursors is None:  # (RankCursors has checked the shards already)
            self._plan(0, 0, loop=True)  # fail now, not mid-training, when no shard can fill a global batch
        self._feed = DeviceFeed(self.device, (micro_batch_tokens // seq_len, seq_len))

    # ------------------------------------------------------------------------------ planning
    def _bos_positions(self, i: int) -> np.ndarray:
        if self._bos is None or self._bos[0] != i:
            self._bos = (i, bos_positions(self._tokens(i), self.bos_id))
        return self._bos[1]

    def _starts_in(self, i: int, pos: int) -> tuple[np.ndarray, int] | None:
        """Chunk starts and end cursor of a global batch planned from `pos` in shard i, or None."""
        m, length = self.micro_batch_tokens, self._lengths[i]
        if not self.align_to_bos:
            # Sub3Min reads a shard it moves to at 0 unchecked (one batch from G + 1 tokens); else the margin
            margin = self.end_margin if pos or i == 0 else 0
            if pos + self.global_batch_tokens + 1 + margin > length:
                return None
            return pos + m * np.arange(self.n_chunks, dtype=np.int64), pos + self.global_batch_tokens
        bos = self._bos_positions(i)
        starts = np.empty(self.n_chunks, dtype=np.int64)
        cursor = pos
        for j in range(self.n_chunks):
            k = int(np.searchsorted(bos, cursor, side="left"))
            if k == len(bos) or int(bos[k]) + m + 1 > length:
                return None
            starts[j] = int(bos[k])
            cursor = starts[j] + m
        return starts, int(cursor)

    def _plan(self, shard: int, pos: int, loop: bool | None = None) -> _Step:
        """The global batch at cursor (shard, pos), moving on shard by shard until one fits."""
        loop = self.loop if loop is None else loop
        cached = self._plan_cache
        if cached is not None and (cached.shard, cached.pos) == (shard, pos):
            return cached
        i, p, wraps = shard, pos, 0
        for _ in range(len(self.files) + 1):
            found = self._starts_in(i, p)
            if found is not None:
                # Cached under the cursor where it was found (wraps 0 from there): the later
                # micro-steps of this step look it up with that cursor.
                self._plan_cache = _Step(i, p, found[0], found[1], 0, np.full(self.n_chunks, i))
                return replace(self._plan_cache, wraps=wraps)
            i, p = i + 1, 0
            if i == len(self.files):
                if not loop:
                    raise DataError(
                        f"training data exhausted after {len(self.files)} shard(s) "
                        f"({self.files[0].parent}); use loop=True or more data"
                    )
                i, wraps = 0, wraps + 1
        if self.align_to_bos:
            check_document_starts(self.files, self.bos_id)
        need = f"{self.global_batch_tokens} + 1 tokens" + (
            f" in {self.n_chunks} chunks that start with bos_id {self.bos_id}" if self.align_to_bos else ""
        )
        raise DataError(
            f"{self.files[0].parent}: too little data: no shard can fill one global batch of {need} "
            f"(largest shard has {max(self._lengths)} tokens, {len(self.files)} shard(s))"
        )

    def _plan_ranks(self, batch: int) -> _Step:
        """Global batch `batch` as the record's ranks read it: chunk c lies in rank c // (chunks per
        rank)'s slice, at offset (c % chunks per rank) * micro."""
        cached = self._plan_cache
        if cached is not None and cached.pos == batch:
            return cached
        shards, starts, epochs = self._cursors.locate(batch)
        if not self.loop and epochs.any():
            raise DataError(
                f"training data exhausted after {len(self.files)} shard(s) "
                f"({self.files[0].parent}); use loop=True or more data"
            )
        per = self.n_chunks // self.rank_cursors
        c = np.arange(self.n_chunks)
        chunk_starts = starts[c // per] + (c % per) * self.micro_batch_tokens
        self._plan_cache = _Step(int(shards[0]), batch, chunk_starts, 0, int(epochs.max()), shards[c // per])
        return self._plan_cache

    def _produce(self, state: tuple[int, int, int, int, int, bool], slot: int):
        """Read this rank's micro-batch at `state`; return host tensors and the following state."""
        shard, pos, micro, epoch, batch, repeat = state
        c = micro * self.world_size + self.rank
        with self._lock:
            step = self._plan_ranks(batch) if self._cursors else self._plan(shard, pos)
            start, i = int(step.starts[c]), int(step.shards[c])
            chunk = np.asarray(self._tokens(i)[start : start + self.micro_batch_tokens + 1])
        x, y = _to_batch(chunk, self.seq_len, self.vocab_size, self.files[i], start)
        x, y = self._feed.stage(slot, x, y)
        if self._cursors:  # the state's shard and pos only report where rank 0 reads
            shard, pos, epoch = step.shard, int(step.starts[0]), step.wraps
        else:
            shard, epoch = step.shard, epoch + step.wraps
            pos = step.pos if micro + 1 < self.accumulation_steps or repeat else step.end
        if micro + 1 < self.accumulation_steps:
            return x, y, (shard, pos, micro + 1, epoch, batch, repeat)
        return x, y, (shard, pos, 0, epoch, batch + (not repeat), False)

    # ------------------------------------------------------------------------------ public
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: inputs and targets, int64, shape (B, T)."""
        t0 = time.perf_counter()
        state = (self._shard, self._pos, self._micro, self._epoch, self._batch, self._repeat)
        if self._future is not None:
            future, self._future = self._future, None
            x, y, nxt, slot = future.result()
        else:
            slot = self._feed.claim()
            x, y, nxt = self._produce(state, slot)
        self.last_wait_s = time.perf_counter() - t0
        self.total_wait_s += self.last_wait_s
        self._shard, self._pos, self._micro, self._epoch, self._batch, self._repeat = nxt
        if self._executor is not None:
            next_slot = self._feed.claim()
            self._future = self._executor.submit(lambda: (*self._produce(nxt, next_slot), next_slot))
        return self._feed.send(slot, x, y)

    def state_dict(self) -> dict:
        """Position of the next micro-batch. At a step boundary (micro_step 0) it is independent of
        rank and world size, so a run may resume on a different number of processes."""
        return {
            "version": 1,
            "files": [f.name for f in self.files],
            "shard": self._shard,
            "pos": self._pos,
            "micro_step": self._micro,
            "epoch": self._epoch,
            "world_size": self.world_size,
            "global_batch_tokens": self.global_batch_tokens,
            "micro_batch_tokens": self.micro_batch_tokens,
            "batch": self._batch,
            "repeat_pending": self._repeat,
            "rank_cursors": self.rank_cursors,
            "end_margin": self.end_margin,
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly where `state_dict()` was taken."""
        self._check_saved(state)
        for key in ("rank_cursors", "end_margin"):  # states from before these keys: 0
            if state.get(key, 0) != getattr(self, key):
                raise ConfigError(
                    f"loader state was saved with {key}={state.get(key, 0)}, not {getattr(self, key)}: "
                    "the data order would change"
                )
        same_split = all(
            state.get(k) == getattr(self, k)
            for k in ("world_size", "global_batch_tokens", "micro_batch_tokens")
        )
        if state["micro_step"] != 0 and not same_split:
            raise ConfigError(
                "loader state taken mid-step can only resume with the same world size and batch sizes"
            )
        self._drain()
        self._shard, self._pos = int(state["shard"]), int(state["pos"])
        self._micro, self._epoch = int(state["micro_step"]), int(state.get("epoch", 0))
        self._repeat = bool(state.get("repeat_pending", False))
        self._batch = int(state.get("batch", 0))


def val_batches(
    files: list[Path],
    val_tokens: int,
    micro_batch_tokens: int,
    seq_len: int,
    rank: int = 0,
    world_size: int = 1,
    vocab_size: int | None = None,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first `val_tokens` tokens of the val shards (not aligned), as chunks `k * W + r` for rank r,
    so the summed loss over all ranks is the same for every world size. Checks run at call time."""
    _assert_split(val_tokens, micro_batch_tokens, seq_len, rank, world_size)
    per_round = world_size * micro_batch_tokens
    files = [Path(f) for f in files]
    assert files, "meta.json lists at least one val shard (load_meta)"
    lengths = [read_header(f) for f in files]
    if sum(lengths) < val_tokens + 1:
        raise DataError(
            f"{files[0].parent}: val shards hold {sum(lengths)} tokens, "
            f"fewer than val_tokens {val_tokens} + 1"
        )
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    maps: dict[int, ShardFile] = {}
    feed = DeviceFeed(torch.device(device), (micro_batch_tokens // seq_len, seq_len), slots=2)

    def read(a: int, b: int) -> tuple[np.ndarray, Path, int]:
        """Tokens [a, b) of the concatenated val stream (a chunk may straddle two shards)."""
        parts, first = [], int(np.searchsorted(offsets, a, side="right") - 1)
        for i in range(first, len(files)):
            lo, hi = max(a, offsets[i]) - offsets[i], min(b, offsets[i + 1]) - offsets[i]
            if hi > lo:
                if i not in maps:
                    maps[i] = read_shard(files[i])
                parts.append(np.asarray(maps[i][lo:hi]))
            if offsets[i + 1] >= b:
                break
        return np.concatenate(parts), files[first], int(a - offsets[first])

    def generate() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for k in range(val_tokens // per_round):
            a = (k * world_size + rank) * micro_batch_tokens
            chunk, path, where = read(a, a + micro_batch_tokens + 1)
            slot = feed.claim()
            x, y = feed.stage(slot, *_to_batch(chunk, seq_len, vocab_size, path, where))
            yield feed.send(slot, x, y)

    return generate()
