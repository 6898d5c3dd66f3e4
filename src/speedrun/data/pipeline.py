"""The streaming half of `prepare`: split documents, tokenize them on all cores in order, cut shards.
Memory stays bounded (one split block, a few batches per worker, one shard written piece by piece) and
results come back in submission order, so the shards are identical for any number of workers."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import numpy as np

from speedrun.data.shards import ShardWriter
from speedrun.data.tokenizers import Tokenizer
from speedrun.errors import ConfigError, DataError

MAX_SPLIT_BLOCK = 1000  # val_fraction is taken as a fraction m/B with B <= this many documents
BATCH_DOCS = 1024  # a tokenizer batch closes at this many documents ...
BATCH_CHARS = 1 << 20  # ... or this many characters of text, whichever comes first
IN_FLIGHT_PER_WORKER = 2  # batches submitted ahead of the one being written, per worker
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def split_plan(val_fraction: float) -> tuple[int, int]:
    """(m, B): every block of B consecutive documents puts m of them, by a seeded draw, in val (no count of
    the corpus needed, at most B documents held, val spread evenly)."""
    frac = Fraction(val_fraction).limit_denominator(MAX_SPLIT_BLOCK)
    if not 0 < frac < 1:
        raise ConfigError(
            f"val_fraction must be between {1 / MAX_SPLIT_BLOCK} and {1 - 1 / MAX_SPLIT_BLOCK}, "
            f"got {val_fraction}"
        )
    return frac.numerator, frac.denominator


def _val_positions(seed: int, block: int, size: int, k: int) -> set[int]:
    return set(np.random.default_rng((seed, block)).choice(size, k, replace=False).tolist())


def assign_splits(docs: Iterable[str], val_fraction: float, seed: int) -> Iterator[tuple[str, bool]]:
    """(document, is_val) in source order; block i's val positions are drawn with seed (seed, i), so a
    document's split depends only on its index. Neither split is ever empty (DataError below 2 documents)."""
    m, size = split_plan(val_fraction)
    held: list[str] = []
    block = n_val = n_docs = 0
    for doc in docs:
        held.append(doc)
        if len(held) == size:
            chosen = _val_positions(seed, block, size, m)
            for i, d in enumerate(held):
                yield d, i in chosen
            n_val, n_docs, block, held = n_val + m, n_docs + size, block + 1, []
    if n_docs + len(held) < 2:
        raise DataError(
            f"need at least 2 documents for a train/val split, the source has {n_docs + len(held)}"
        )
    if held:
        k = round(m * len(held) / size)
        if n_val == 0:
            k = min(max(k, 1), len(held) - 1)  # first block only: keep both splits non-empty
        chosen = _val_positions(seed, block, len(held), k)
        for i, d in enumerate(held):
            yield d, i in chosen


@dataclass
class Batch:
    texts: list[str] = field(default_factory=list)
    is_val: list[bool] = field(default_factory=list)
    chars: int = 0


def batches(
    pairs: Iterable[tuple[str, bool]], max_docs: int | None = None, max_chars: int | None = None
) -> Iterator[Batch]:
    """Group (document, is_val) pairs into tokenizer batches bounded in documents and characters
    (default BATCH_DOCS and BATCH_CHARS)."""
    max_docs, max_chars = max_docs or BATCH_DOCS, max_chars or BATCH_CHARS
    batch = Batch()
    for text, is_val in pairs:
        batch.texts.append(text)
        batch.is_val.append(is_val)
        batch.chars += len(text)
        if len(batch.texts) >= max_docs or batch.chars >= max_chars:
            yield batch
            batch = Batch()
    if batch.texts:
        yield batch


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP during prepare, handled as Ctrl-C is; the CLI exits with 128 + `signum`."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP interrupt the block as Ctrl-C does, so prepare removes its temporary folder
    (gigabytes for FineWeb) instead of dying with it in place."""

    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    previous = {}
    with contextlib.suppress(ValueError):  # only the main thread may set handlers
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_worker_tok: Tokenizer | None = None


def _init_worker(tok: Tokenizer, parent: int) -> None:
    """Keep the tokenizer; ignore the stop signals (stopping is the parent's alone: a worker killed mid-way
    could hold a queue's lock and hang the pool) and die with the parent (no orphans)."""
    global _worker_tok
    _worker_tok = tok
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _die_with_parent(parent)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its parent exits (prctl PR_SET_PDEATHSIG); elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def encode_texts(texts: list[str], tok: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, per-document token counts, per-document UTF-8 bytes) for a batch: every document
    becomes [eot] + its ids, concatenated into one uint16 array."""
    tok = tok or _worker_tok
    assert tok is not None, "worker not initialized"
    ids = [tok.encoding.encode_ordinary(t) for t in texts]
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    out = np.empty(int(lengths.sum()), dtype=np.uint16)
    pos = 0
    for x, n in zip(ids, lengths.tolist(), strict=True):
        out[pos] = tok.eot_id
        out[pos + 1 : pos + n] = x
        pos += n
    n_bytes = np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))
    return out, lengths, n_bytes


def default_workers() -> int:
    """All cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def encode_batches(batch_iter: Iterable[Batch], tok: Tokenizer, workers: int) -> Iterator[tuple]:
    """(is_val list, tokens, lengths, bytes) per batch, in input order, on `workers` processes; a bounded
    window of batches is submitted ahead, and the pool starts only at the second batch."""
    it = iter(batch_iter)
    head = [b for b in (next(it, None), next(it, None) if workers > 1 else None) if b is not None]
    if len(head) < 2:  # one batch, or one worker: encode here, in order
        for b in _chain(head, it):
            yield (b.is_val, *encode_texts(b.texts, tok))
        return
    with _start_pool(workers, tok) as pool:
        pending: deque = deque()
        for b in _chain(head, it):
            pending.append((b.is_val, pool.apply_async(encode_texts, (b.texts,))))
            del b  # the pool holds the texts until a worker takes them; we need only the flags
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                is_val, res = pending.popleft()
                yield (is_val, *res.get())
        while pending:
            is_val, res = pending.popleft()
            yield (is_val, *res.get())


@contextmanager
def _start_pool(workers: int, tok: Tokenizer) -> Iterator[Any]:
    """A pool of `workers` tokenizer processes (and the resource tracker) started with the stop signals
    blocked, so a Ctrl-C or SIGHUP to the process group reaches only us; stopped on leaving."""
    ctx = multiprocessing.get_context("spawn")  # no fork: the parent may hold threads (tqdm, hub)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        resource_tracker.ensure_running()  # starting it unblocks SIGINT and SIGTERM here: block again
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tok, os.getpid()))
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a Ctrl-C held back meanwhile arrives here
        yield pool
    finally:  # the workers finish what is queued (a second or so) and leave: nothing killed mid-write
        pool.close()
        pool.join()


def _chain(head: list[Batch], rest: Iterator[Batch]) -> Iterator[Batch]:
    """`head` then `rest`, dropping each head batch as it is handed on (nothing kept alive)."""
    while head:
        yield head.pop(0)
    yield from rest


class SplitWriter:
    """Cuts one split's token stream into shards `<slug>_<split>_NNNNNN.bin` of `shard_tokens`
    (the last one shorter); a document may continue into the next shard, as in modded-nanogpt."""

    def __init__(self, out_dir: Path, slug: str, split: str, shard_tokens: int) -> None:
        self.out_dir, self.slug, self.split, self.shard_tokens = Path(out_dir), slug, split, shard_tokens
        self.shards: list[str] = []
        self.tokens = self.documents = self.bytes = 0
        self._open: ShardWriter | None = None

    def write(self, tokens: np.ndarray, documents: int, n_bytes: int) -> None:
        self.tokens += tokens.size
        self.documents += documents
        self.bytes += n_bytes
        while tokens.size:
            if self._open is None:
                name = f"{self.slug}_{self.split}_{len(self.shards):06d}.bin"
                self._open = ShardWriter(self.out_dir / name)
                self.shards.append(name)
            room = self.shard_tokens - self._open.count
            self._open.write(tokens[:room])
            tokens = tokens[room:]
            if self._open.count == self.shard_tokens:
                self._open.close()
                self._open = None

    def close(self) -> dict:
        """Finish the last shard; the split's entry for meta.json."""
        if self._open is not None:
            self._open.close()
            self._open = None
        return {
            "tokens": self.tokens,
            "documents": self.documents,
            "bytes": self.bytes,
            "shards": self.shards,
        }

    def abort(self) -> None:
        if self._open is not None:
            self._open.abort()
            self._open = None
