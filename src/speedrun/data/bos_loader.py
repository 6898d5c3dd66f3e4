"""Document-aligned training batches with `cu_seqlens` (records #26 on); batch size and longest
document may change per stage. Rank r's k-th micro-step reads chunk `k * world_size + r` of a global
batch planned from the cursor (shard, pos) alone, so a step holds the same tokens on 1, 2 or 8
processes. Rules: `stream` (#26 `find_batch_starts`: `local + 1` tokens from a BOS, next chunk at the
first BOS after; a shard is left when `pos + 2·G + 1 >= len`) and `packed` (#29 on: whole documents
cut to `max_doc_len`, the last cut to fill). `cu_seqlens` has a fixed length `max_docs` (padded; extra
boundaries are dropped, merging documents, where the records crash); #92's attention segments add a
boundary every `segment` tokens into a longer document (attention only: the tokens are untouched). The
next shard's BOS index is built in the background, and with `prefetch` the next micro-batch too (#33).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from threading import Lock

import numpy as np
import torch

from speedrun.data.loader import ShardReader
from speedrun.data.shards import (
    bos_positions,
    check_document_starts,
    check_token_range,
)
from speedrun.errors import ConfigError, DataError

RULES = ("stream", "packed")
#: The records' fixed document counts per chunk size (#78 on: TRAIN_MAX_NUM_DOCS), else the size / 300
#: rounded up to 128 (as before #78).
RECORD_MAX_DOCS = {16384: 64, 32768: 96, 49152: 128}

#: step -> (global batch tokens, longest document in tokens; 0 = no limit[, longest attention segment in
#: tokens; 0 or absent = whole documents])
StageFn = Callable[[int], tuple[int, ...]]


def record_max_docs(chunk_tokens: int) -> int:
    """`cu_seqlens` length the records use for a chunk of `chunk_tokens` tokens."""
    return RECORD_MAX_DOCS.get(chunk_tokens, -(-(chunk_tokens // 300) // 128) * 128 or 128)


def plan_stream(bos: np.ndarray, length: int, pos: int, chunks: int, local: int):
    """#26's chunk starts and the cursor after them, or None when the shard must be left."""
    if pos + 2 * chunks * local + 1 >= length:
        return None
    k = int(np.searchsorted(bos, pos))
    if k == len(bos):
        return None
    start, segments = int(bos[k]), []
    for _ in range(chunks):
        if start + local + 1 > length:
            return None
        segments.append([(start, start + local + 1)])
        k = int(np.searchsorted(bos, start + local))
        start = int(bos[k]) if k < len(bos) else length
    return segments, start


def plan_packed(bos: np.ndarray, length: int, pos: int, chunks: int, local: int, max_doc: int):
    """The records' packed chunks (documents cut to `max_doc`, last one cut to fill) as (start, end)
    segments, and the cursor after them; None when the shard's documents run out first."""
    k, n, segments = int(np.searchsorted(bos, pos)), len(bos), []
    for _ in range(chunks):
        segs, filled = [], 0
        while filled <= local:
            if k >= n:
                return None
            cur = int(bos[k])
            k += 1
            end = min(int(bos[k]) if k < n else length, cur + local - filled + 1)
            if max_doc > 0:
                end = min(end, cur + max_doc)
            segs.append((cur, end))
            filled += end - cur
        segments.append(segs)
    return segments, int(bos[k]) if k < n else length


def cu_seqlens(inputs: np.ndarray, bos_id: int, max_docs: int, segment: int = 0) -> tuple[np.ndarray, int]:
    """Padded document offsets of one chunk's inputs, and how many boundaries did not fit; with `segment`,
    also every `segment` tokens into a document (#92's virtual attention cap)."""
    n = len(inputs)
    starts = np.flatnonzero(inputs == bos_id)
    starts = starts[starts > 0]
    if segment > 0:
        starts = segment_starts(starts, n, segment)
    dropped = max(0, len(starts) - (max_docs - 2))
    out = np.full(max_docs, n, dtype=np.int32)
    out[0] = 0
    out[1 : 1 + len(starts) - dropped] = starts[: len(starts) - dropped]
    return out, dropped


def segment_starts(starts: np.ndarray, n: int, segment: int) -> np.ndarray:
    """Document starts (> 0) of a row of `n` tokens and, in each document [a, b), a + segment, a + 2·segment
    … below b: attention segments of at most `segment` tokens (record #92's `_virtual_ends`)."""
    edges = np.concatenate(([0], starts, [n]))
    cuts = [np.arange(a + segment, b, segment) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return np.sort(np.concatenate([starts, *cuts])).astype(starts.dtype)


@dataclass(frozen=True)
class _Plan:
    shard: int
    pos: int
    step: int
    segments: list
    end: int
    wraps: int


class DocumentLoader(ShardReader):
    """BOS-aligned, stage-sized training batches with `cu_seqlens` (see the module docstring)."""

    def __init__(
        self,
        files: list[Path],
        chunks: int,
        stage_of: StageFn,
        bos_id: int,
        rank: int = 0,
        world_size: int = 1,
        rule: str = "packed",
        max_docs: int = 0,
        vocab_size: int | None = None,
        device: str | torch.device = "cpu",
        loop: bool = True,
        prefetch: bool | None = None,
        with_cu_seqlens: bool = False,
    ):
        # run_data.micro_batch_tokens and the config checked these once, at set-up
        assert 0 <= rank < world_size and chunks % world_size == 0 and rule in RULES, (rank, chunks, rule)
        super().__init__(files, device, prefetch)
        self.chunks, self.stage_of, self.bos_id, self.rule = chunks, stage_of, bos_id, rule
        self.rank, self.world_size, self.accumulation_steps = rank, world_size, chunks // world_size
        self.max_docs, self.vocab_size, self.loop = max_docs, vocab_size, loop
        self.with_cu_seqlens = with_cu_seqlens  # next_batch() adds cu_seqlens (model.attention=varlen)
        self._index: dict[int, Future] = {}
        self._indexer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speedrun-bos-index")
        self._lock = Lock()
        self._cache: _Plan | None = None
        self._shard, self._pos, self._micro, self._step = 0, 0, 0, 0
        self._plan(0, 0, 0)  # fail now, not mid-training, when no shard can fill the first batch

    # ------------------------------------------------------------------------------ planning
    def _scan(self, i: int) -> np.ndarray:
        return bos_positions(self._tokens(i), self.bos_id)

    def _bos(self, i: int) -> np.ndarray:
        """BOS positions of shard i; the next shard's index is started in the background."""
        if i not in self._index:
            self._index[i] = self._indexer.submit(self._scan, i)
        nxt = (i + 1) % len(self.files)
        if nxt not in self._index:
            self._index[nxt] = self._indexer.submit(self._scan, nxt)
        for old in [j for j in self._index if j not in (i, nxt)]:
            del self._index[old]  # keep two indexes: a shard's positions can be large
        return self._index[i].result()

    def _stage(self, step: int) -> tuple[int, int, int, int]:
        """(tokens per chunk, longest document, cu_seqlens length, longest attention segment) of `step`."""
        tokens, max_doc, *segment = self.stage_of(step)
        assert tokens >= self.chunks and tokens % self.chunks == 0, (step, tokens)  # config_stages checks it
        local = tokens // self.chunks
        return local, max_doc, self.max_docs or record_max_docs(local), segment[0] if segment else 0

    def _plan(self, shard: int, pos: int, step: int) -> _Plan:
        """The global batch of `step` from cursor (shard, pos), moving on shard by shard until it fits."""
        c = self._cache
        if c is not None and (c.shard, c.pos, c.step) == (shard, pos, step):
            return c
        local, max_doc, _, _ = self._stage(step)
        i, p, wraps = shard, pos, 0
        for _ in range(len(self.files) + 1):
            bos, length = self._bos(i), self._lengths[i]
            if self.rule == "stream":
                found = plan_stream(bos, length, p, self.chunks, local)
            else:
                found = plan_packed(bos, length, p, self.chunks, local, max_doc)
            if found is not None:
                self._cache = _Plan(i, p, step, found[0], found[1], 0)  # found from (i, p): no wrap
                return _Plan(i, p, step, found[0], found[1], wraps)
            i, p = i + 1, 0
            if i == len(self.files):
                if not self.loop:
                    raise DataError(
                        f"training data exhausted after {len(self.files)} shard(s) ({self.files[0].parent})"
                    )
                i, wraps = 0, wraps + 1
        check_document_starts(self.files, self.bos_id)
        raise DataError(
            f"{self.files[0].parent}: no shard holds one global batch of {self.chunks} x {local} + 1 "
            f"BOS-aligned tokens (largest shard {max(self._lengths)} tokens)"
        )

    def _produce(self, state: tuple[int, int, int, int, int]):
        """This rank's micro-batch at `state` as host arrays, and the state after it."""
        shard, pos, micro, step, epoch = state
        c = micro * self.world_size + self.rank
        with self._lock:
            plan = self._plan(shard, pos, step)
            # the step may lie in a later shard: its cursor moves there (later micro-steps hit the cache)
            shard, pos, epoch = plan.shard, plan.pos, epoch + plan.wraps
            tokens = self._tokens(shard)
            buf = np.concatenate([np.asarray(tokens[a:b]) for a, b in plan.segments[c]])
            _, _, max_docs, segment = self._stage(step)
        if self.vocab_size is not None:
            check_token_range(buf, self.vocab_size, self.files[shard])
        cu, _ = cu_seqlens(buf[:-1], self.bos_id, max_docs, segment)
        x = torch.from_numpy(buf[:-1].astype(np.int64))
        y = torch.from_numpy(buf[1:].astype(np.int64))
        cu_t = torch.from_numpy(cu)
        if self.device.type == "cuda":
            x, y, cu_t = x.pin_memory(), y.pin_memory(), cu_t.pin_memory()
        if micro + 1 < self.accumulation_steps:
            return (x, y, cu_t), (shard, pos, micro + 1, step, epoch)
        return (x, y, cu_t), (shard, plan.end, 0, step + 1, epoch)

    # ------------------------------------------------------------------------------ public
    def next_packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: inputs and targets (T,) int64, cu_seqlens (max_docs,) int32."""
        t0 = time.perf_counter()
        state = (self._shard, self._pos, self._micro, self._step, self._epoch)
        if self._future is not None:
            future, self._future = self._future, None
            out, nxt = future.result()
        else:
            out, nxt = self._produce(state)
        self.last_wait_s = time.perf_counter() - t0
        self.total_wait_s += self.last_wait_s
        self._shard, self._pos, self._micro, self._step, self._epoch = nxt
        if self._executor is not None:
            self._future = self._executor.submit(self._produce, nxt)
        x, y, cu = out
        if self.device.type == "cpu":
            return x, y, cu
        return (t.to(self.device, non_blocking=True) for t in (x, y, cu))  # type: ignore[return-value]

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """The next micro-batch as one (1, T) row, for models that find documents from the BOS tokens,
        or (with `with_cu_seqlens`) that take them as cu_seqlens."""
        x, y, cu = self.next_packed()
        return (x.view(1, -1), y.view(1, -1), cu) if self.with_cu_seqlens else (x.view(1, -1), y.view(1, -1))

    def state_dict(self) -> dict:
        """Cursor of the current step, micro-step and step; world-size free at a step boundary."""
        return {
            "version": 1,
            "kind": "documents",
            "files": [f.name for f in self.files],
            "fingerprint": self.fingerprint(),
            "rule": self.rule,
            "chunks": self.chunks,
            "world_size": self.world_size,
            "shard": self._shard,
            "pos": self._pos,
            "micro_step": self._micro,
            "step": self._step,
            "epoch": self._epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly where `state_dict()` was taken."""
        if state.get("kind") != "documents":
            raise ConfigError(
                "loader state was saved by the token loader, not the document loader (data.loader)"
            )
        self._check_saved(state)
        for key in ("rule", "chunks"):
            if state.get(key) != getattr(self, key):
                raise ConfigError(
                    f"loader state was saved with {key}={state.get(key)}, not {getattr(self, key)}"
                )
        if state["micro_step"] and state["world_size"] != self.world_size:
            raise ConfigError("loader state taken mid-step can only resume with the same world size")
        self._drain()
        self._shard, self._pos, self._micro = int(state["shard"]), int(state["pos"]), int(state["micro_step"])
        self._step, self._epoch = int(state["step"]), int(state["epoch"])

    def close(self) -> None:
        """Stop the background threads."""
        super().close()
        self._indexer.shutdown(wait=True)
