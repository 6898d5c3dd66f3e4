"""The `.bin` token shard format, byte-compatible with modded-nanogpt / llm.c files: a header of 256
little-endian int32 (magic 20240520, version 1, token count), then uint16 tokens. Ids above 65,535 are
refused at write time: a wider body needs a new version number, never silent truncation."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

from speedrun.errors import DataError

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKEN_ID = np.iinfo(np.uint16).max  # 65,535: the largest id version 1 can store
_TOKEN_DTYPE = np.dtype("<u2")
SCAN_BLOCK = 1 << 24  # tokens per block when scanning a memmap, to bound temporary memory


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """Write 1-D integer `tokens` as one shard, atomically (through ShardWriter)."""
    tokens = np.asarray(tokens)
    assert tokens.ndim == 1 and (not tokens.size or np.issubdtype(tokens.dtype, np.integer)), tokens.dtype
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(path)
    try:
        writer.write(tokens)
        writer.close()
    except BaseException:
        writer.abort()
        raise


class ShardWriter:
    """Write one shard piece by piece (memory does not grow with it) into a hidden temporary file; `close`
    writes the header, fsyncs and renames it, so a crash or `abort` never leaves a file under `path`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.count = 0
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        self._tmp = Path(tmp)
        os.fchmod(fd, 0o644)
        self._file = os.fdopen(fd, "wb")
        self._file.write(bytes(HEADER_BYTES))

    def write(self, tokens: np.ndarray) -> None:
        """Append uint16 tokens (other dtypes are range-checked and converted)."""
        if tokens.dtype != _TOKEN_DTYPE:
            lo, hi = (int(tokens.min()), int(tokens.max())) if tokens.size else (0, 0)
            if lo < 0 or hi > MAX_TOKEN_ID:
                raise DataError(
                    f"{self.path}: token ids do not fit shard version {VERSION} (uint16, ids 0..65535): "
                    f"{hi if hi > MAX_TOKEN_ID else lo}; vocabularies above 65,535 need a new version"
                )
            tokens = tokens.astype(_TOKEN_DTYPE)
        self._file.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        self.count += tokens.size

    def close(self) -> None:
        """Finish the header and move the shard into place."""
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[0], header[1], header[2] = MAGIC, VERSION, self.count
        self._file.seek(0)
        self._file.write(header.tobytes())
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Drop the partial file (closing may fail to flush, e.g. on a full disk: it is dropped anyway)."""
        with contextlib.suppress(OSError):
            self._file.close()
        self._tmp.unlink(missing_ok=True)


def read_header(path: Path) -> int:
    """A shard's token count, after checking its header and body length (a truncated download or copy
    must not be read as garbage tokens deep inside training)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise DataError(f"{path}: shard file not found") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read shard: {e.strerror or e}") from None
    if len(raw) < HEADER_BYTES:
        raise DataError(f"{path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte shard header")
    header = np.frombuffer(raw, dtype="<i4")
    if int(header[0]) != MAGIC:
        raise DataError(f"{path}: bad magic number {int(header[0])} (expected {MAGIC}); not a token shard")
    if int(header[1]) != VERSION:
        raise DataError(f"{path}: unsupported shard version {int(header[1])} (expected {VERSION})")
    count = int(header[2])
    if count < 0:
        raise DataError(f"{path}: negative token count {count} in header")
    body = size - HEADER_BYTES
    if body != 2 * count:
        kind = "truncated" if body < 2 * count else "overlong"
        raise DataError(
            f"{path}: {kind} body: header says {count} tokens ({2 * count} bytes) but body has {body} bytes"
        )
    return count


def open_shard(path: Path, vocab_size: int | None = None) -> np.ndarray:
    """Map a validated shard's tokens read-only; with `vocab_size`, check the ids fit (an out-of-range id
    would crash or silently misindex the embedding on the GPU)."""
    path = Path(path)
    count = read_header(path)
    if count == 0:
        tokens = np.zeros(0, dtype=_TOKEN_DTYPE)
    else:
        tokens = np.memmap(path, dtype=_TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))
    if vocab_size is not None:
        check_token_range(tokens, vocab_size, path)
    return tokens


class ShardFile:
    """A validated shard's tokens, read from the file on each slice (os.pread), never mapped: what a run
    trains and validates from. A shard cut or rewritten under a mapped run kills it with SIGBUS (no line, no
    checkpoint); here each read checks that the file is the one validated (size and modification time of the
    open file) and a changed one is a DataError naming it. A file replaced by a rename keeps being read as it
    was: the run holds the old one open. Supports len() and slices [a:b] (read-only uint16 arrays)."""

    def __init__(self, path: Path, count: int):
        self.path, self.count = Path(path), count
        self._fd = os.open(self.path, os.O_RDONLY)
        st = os.fstat(self._fd)
        self._stamp = (st.st_size, st.st_mtime_ns)
        if st.st_size != HEADER_BYTES + 2 * count:  # changed between its validation and this open
            self._changed(0, count)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: slice) -> np.ndarray:
        assert isinstance(key, slice) and key.step in (None, 1), "a shard is read by contiguous slices"
        start, stop, _ = key.indices(self.count)
        n = max(0, stop - start)
        data = os.pread(self._fd, 2 * n, HEADER_BYTES + 2 * start) if n else b""
        st = os.fstat(self._fd)
        if len(data) != 2 * n or (st.st_size, st.st_mtime_ns) != self._stamp:
            self._changed(start, n)
        return np.frombuffer(data, dtype=_TOKEN_DTYPE)

    def _changed(self, start: int, n: int) -> None:
        raise DataError(
            f"{self.path}: the shard changed while the run read it (tokens {start:,}..{start + n:,}; it "
            f"was {self.count:,} tokens when the run opened it): a run trains on the data it started with; "
            "restore the shard (or prepare into another folder) and resume from the last checkpoint"
        )

    def __del__(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.close(self._fd)


def read_shard(path: Path) -> ShardFile:
    """A validated shard read slice by slice (`ShardFile`): the training and validation loaders' way."""
    return ShardFile(Path(path), read_header(Path(path)))


def shard_fingerprint(path: Path, head_tokens: int = 1 << 16) -> str:
    """`<token count>:<sha256 of the first tokens, 16 hex>`: tells a shard prepared again under the same
    name (other text, another vocabulary) from the original, reading at most 128 KiB."""
    tokens = open_shard(path)
    head = np.ascontiguousarray(tokens[:head_tokens]).tobytes()
    return f"{len(tokens)}:{hashlib.sha256(head).hexdigest()[:16]}"


def check_token_range(tokens: np.ndarray, vocab_size: int, path: Path, offset: int = 0) -> None:
    """DataError naming the file and the id when any token is >= vocab_size, scanning in blocks (a 100
    M-token memmap is never one temporary array)."""
    for start in range(0, len(tokens), SCAN_BLOCK):
        part = tokens[start : start + SCAN_BLOCK]
        hi = int(part.max())
        if hi >= vocab_size:
            where = offset + start + int(np.argmax(part >= vocab_size))
            raise DataError(
                f"{path}: token id {hi} is out of range for vocab_size {vocab_size} "
                f"(first bad token at {where})"
            )


def bos_positions(tokens: np.ndarray, bos_id: int) -> np.ndarray:
    """Sorted positions of `bos_id` in `tokens`, scanned in blocks (only the positions are kept)."""
    parts = [
        np.flatnonzero(tokens[s : s + SCAN_BLOCK] == bos_id) + s for s in range(0, len(tokens), SCAN_BLOCK)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def check_document_starts(files: list[Path], bos_id: int) -> None:
    """A DataError when no shard holds `bos_id` (no separator, or another id), so that a loader that cuts
    batches at document starts does not report it as too little data."""
    for path in files:
        tokens = open_shard(path)
        for start in range(0, len(tokens), SCAN_BLOCK):
            if np.any(tokens[start : start + SCAN_BLOCK] == bos_id):
                return
    raise DataError(
        f"{Path(files[0]).parent}: no document start in {len(files)} shard(s): no token holds the "
        f"end-of-text id {bos_id} that begins every document (shards written without separators, or "
        "model.eot_id is not the data's end-of-text id)"
    )
