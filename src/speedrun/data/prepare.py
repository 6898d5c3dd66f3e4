"""`speedrun prepare`: text source -> tokenizer -> `.bin` shards + `meta.json`, reproducibly.

The train/val split is by whole document with a seeded permutation, so the same source, seed and
tokenizer always give byte-identical shards. Everything is built in a hidden temporary folder next to
the target and renamed into place at the end, with `meta.json` written last: a folder with a
`meta.json` under the target name is always complete, and an interrupted prepare leaves only a
`.<name>.tmp-*` folder behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from speedrun.atomic import write_atomic
from speedrun.data.shards import write_shard
from speedrun.data.sources import iter_documents, source_slug
from speedrun.data.tokenizers import (
    Tokenizer,
    gpt2_tokenizer,
    load_tokenizer,
    parse_bpe_size,
    save_tokenizer,
    train_bpe_tokenizer,
)
from speedrun.errors import ConfigError, DataError

META_FILE = "meta.json"
META_FORMAT = "speedrun-shards"
META_VERSION = 1
FINEWEB = "fineweb10B"
FINEWEB_DEFAULT_SHARDS = 9
_ENCODE_BATCH_DOCS = 1024


def _check_tokenizer_name(tokenizer: str) -> None:
    if tokenizer != "gpt2":
        parse_bpe_size(tokenizer)  # ConfigError for anything that is not bpe:N with a sane N


def parse_fineweb_source(source: str) -> int | None:
    """Number of train shards for `fineweb10B[:N]`, or None when `source` is not FineWeb."""
    if source == FINEWEB:
        return FINEWEB_DEFAULT_SHARDS
    if not source.startswith(FINEWEB + ":"):
        return None
    raw = source[len(FINEWEB) + 1 :]
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"source {source!r}: N in fineweb10B:N must be a positive integer (train shards)")
    return int(raw)


def default_data_dir(source: str, tokenizer: str) -> Path:
    """`data/<source-slug>` for gpt2, `data/<source-slug>-bpe<N>` for bpe:N (relative to the cwd)."""
    _check_tokenizer_name(tokenizer)
    slug = source_slug(source)
    if tokenizer == "gpt2":
        return Path("data") / slug
    return Path("data") / f"{slug}-bpe{parse_bpe_size(tokenizer)}"


def split_documents(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask, True for validation documents: a seeded permutation picks
    max(1, round(val_fraction * n)) documents, so both splits are never empty."""
    if n_docs < 2:
        raise DataError(f"need at least 2 documents for a train/val split, the source has {n_docs}")
    n_val = min(n_docs - 1, max(1, round(val_fraction * n_docs)))
    is_val = np.zeros(n_docs, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True
    return is_val


def _write_split(
    tok: Tokenizer, docs: list[str], split: str, slug: str, out_dir: Path, shard_tokens: int
) -> dict:
    """Encode `docs` as [eot] + tokens each and cut the stream into shards of `shard_tokens`
    (the last one shorter); a document may continue into the next shard, as in modded-nanogpt."""
    shards: list[str] = []
    pending: list[np.ndarray] = []
    pending_n = 0
    total = 0

    def flush(n: int) -> None:
        nonlocal pending, pending_n
        stream = np.concatenate(pending)
        name = f"{slug}_{split}_{len(shards):06d}.bin"
        write_shard(out_dir / name, stream[:n])
        shards.append(name)
        rest = stream[n:]
        pending, pending_n = ([rest] if rest.size else []), rest.size

    for start in range(0, len(docs), _ENCODE_BATCH_DOCS):
        for ids in tok.encode_batch(docs[start : start + _ENCODE_BATCH_DOCS]):
            arr = np.empty(len(ids) + 1, dtype=np.uint16)
            arr[0] = tok.eot_id
            arr[1:] = ids
            pending.append(arr)
            pending_n += arr.size
            total += arr.size
        while pending_n >= shard_tokens:
            flush(shard_tokens)
    if pending_n:
        flush(pending_n)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    return {"tokens": total, "documents": len(docs), "bytes": n_bytes, "shards": shards}


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write JSON under a temporary name, fsync, rename: readers see the old file or the new one."""
    write_atomic(path, (json.dumps(obj, indent=2) + "\n").encode())


def _check_target(data_dir: Path) -> None:
    """Refuse to replace a folder that is not ours: it may hold the user's files."""
    if data_dir.exists() and (
        not data_dir.is_dir() or (any(data_dir.iterdir()) and not (data_dir / META_FILE).is_file())
    ):
        raise DataError(
            f"{data_dir}: exists and is not a prepared data folder (no {META_FILE}); not replacing it"
        )


def _install(tmp: Path, data_dir: Path) -> None:
    """Move the finished folder into place, replacing an earlier prepared folder of the same name."""
    _check_target(data_dir)
    old = None
    if data_dir.exists():
        old = Path(tempfile.mkdtemp(dir=data_dir.parent, prefix=f".{data_dir.name}.old-"))
        os.replace(data_dir, old / "x")
    try:
        os.replace(tmp, data_dir)
    except BaseException:
        if old is not None:  # put the earlier folder back rather than leave nothing
            os.replace(old / "x", data_dir)
            old.rmdir()
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prepare(
    source: str,
    tokenizer: str = "gpt2",
    data_dir: Path | None = None,
    val_fraction: float = 0.05,
    seed: int = 1337,
    shard_tokens: int = 100_000_000,
    log: Callable[[str], object] = print,
) -> Path:
    """Build `data_dir` (default `default_data_dir(source, tokenizer)`) and return it."""
    n_fineweb = parse_fineweb_source(source)
    if n_fineweb is not None:
        if tokenizer != "gpt2":
            raise ConfigError(f"source {source!r} is pre-tokenized with gpt2; got tokenizer {tokenizer!r}")
        from speedrun.data.fineweb import download_fineweb

        return download_fineweb(n_fineweb, Path(data_dir) if data_dir else Path("data") / FINEWEB, log=log)
    _check_tokenizer_name(tokenizer)
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens must be positive, got {shard_tokens}")
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir(source, tokenizer)
    _check_target(data_dir)

    docs = list(iter_documents(source))
    is_val = split_documents(len(docs), val_fraction, seed)
    splits = {
        "val": [d for d, v in zip(docs, is_val, strict=True) if v],
        "train": [d for d, v in zip(docs, is_val, strict=True) if not v],
    }
    log(f"prepare {source}: {len(docs)} documents ({len(splits['val'])} val), tokenizer {tokenizer}")

    data_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=data_dir.parent, prefix=f".{data_dir.name}.tmp-"))
    try:
        tmp.chmod(0o755)  # mkdtemp makes a private folder; the result is ordinary shared data
        if tokenizer == "gpt2":
            tok = gpt2_tokenizer()
        else:
            tok = train_bpe_tokenizer(splits["train"], parse_bpe_size(tokenizer))
            save_tokenizer(tok, tmp)
        slug = source_slug(source)
        stats = {s: _write_split(tok, splits[s], s, slug, tmp, shard_tokens) for s in ("val", "train")}
        meta = {
            "format": META_FORMAT,
            "version": META_VERSION,
            "source": source,
            "tokenizer": tok.name,
            "tokenizer_hash": tok.hash,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "seed": seed,
            "val_fraction": val_fraction,
            "splits": stats,
        }
        write_json_atomic(tmp / META_FILE, meta)
        _install(tmp, data_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for s in ("train", "val"):
        log(
            f"  {s}: {stats[s]['tokens']:,} tokens, {stats[s]['documents']:,} documents, "
            f"{len(stats[s]['shards'])} shard(s)"
        )
    log(f"wrote {data_dir}")
    return data_dir


def _hint(data_dir: Path) -> str:
    return f"run `speedrun prepare SOURCE --data-dir {data_dir}` (e.g. SOURCE = wiki-vital)"


def load_meta(data_dir: Path) -> dict:
    """Read and validate `data_dir/meta.json`; its presence is what marks a folder as complete."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: data folder not found; {_hint(data_dir)}")
    path = data_dir / META_FILE
    if not path.is_file():
        raise DataError(f"{path}: missing (data not prepared or incomplete); {_hint(data_dir)}")
    try:
        meta = json.loads(path.read_text())
        if meta["format"] != META_FORMAT or meta["version"] != META_VERSION:
            raise ValueError(f"format {meta['format']!r} version {meta['version']!r}")
        for key, typ in (("tokenizer", str), ("tokenizer_hash", str), ("vocab_size", int), ("eot_id", int)):
            if not isinstance(meta[key], typ):
                raise TypeError(f"{key} must be {typ.__name__}")
        for split in ("train", "val"):
            info = meta["splits"][split]
            if not isinstance(info["tokens"], int) or not all(isinstance(s, str) for s in info["shards"]):
                raise TypeError(f"bad entry for split {split!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: invalid ({type(e).__name__}: {e}); {_hint(data_dir)}") from None
    for split in ("train", "val"):
        for name in meta["splits"][split]["shards"]:
            if not (data_dir / name).is_file():
                raise DataError(
                    f"{data_dir / name}: shard listed in {META_FILE} is missing; {_hint(data_dir)}"
                )
    return meta


def shard_paths(data_dir: Path, split: str, meta: dict | None = None) -> list[Path]:
    """The shard files of `split` exactly as `meta.json` lists them."""
    meta = meta if meta is not None else load_meta(data_dir)
    return [Path(data_dir) / name for name in meta["splits"][split]["shards"]]


def check_tokenizer(meta: dict, tokenizer: Tokenizer, data_dir: Path | None = None) -> None:
    """DataError unless `tokenizer` is the vocabulary the shards were written with."""
    where = f"{Path(data_dir) / META_FILE}" if data_dir is not None else META_FILE
    if meta.get("tokenizer") != tokenizer.name or meta.get("tokenizer_hash") != tokenizer.hash:
        raise DataError(
            f"{where}: data was tokenized with {meta.get('tokenizer')!r} "
            f"(hash {meta.get('tokenizer_hash')}), "
            f"not {tokenizer.name!r} (hash {tokenizer.hash}); prepare the data again"
        )


def tokenizer_for_data(data_dir: Path, meta: dict | None = None) -> Tokenizer:
    """Load the tokenizer `data_dir` was made with and verify its hash against `meta.json`."""
    meta = meta if meta is not None else load_meta(data_dir)
    tok = load_tokenizer(meta["tokenizer"], data_dir)
    check_tokenizer(meta, tok, data_dir)
    return tok
