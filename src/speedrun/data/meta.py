"""`meta.json`: what marks a folder of shards as complete, and how it is read back.

Shared by `prepare` (text sources) and `fineweb` (downloaded shards), which is why it lives on its
own: neither of those modules needs to import the other for it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from speedrun.atomic import write_atomic
from speedrun.data.shards import read_header
from speedrun.errors import DataError

META_FILE = "meta.json"
META_FORMAT = "speedrun-shards"
META_VERSION = 1


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write JSON under a temporary name, fsync, rename: readers see the old file or the new one."""
    write_atomic(path, (json.dumps(obj, indent=2) + "\n").encode())


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
            if not isinstance(meta[key], typ) or isinstance(meta[key], bool):
                raise TypeError(f"{key} must be {typ.__name__}")
        if not 0 <= meta["eot_id"] < meta["vocab_size"]:  # it marks documents (document_mask, align_to_bos)
            raise ValueError(f"eot_id {meta['eot_id']} is not a token id of vocab_size {meta['vocab_size']}")
        for split in ("train", "val"):
            info = meta["splits"][split]
            shards = info["shards"]
            tokens = info["tokens"]
            if not isinstance(tokens, int) or tokens < 0 or not isinstance(shards, list) or not shards:
                raise TypeError(f"bad entry for split {split!r}")
            if not all(isinstance(s, str) and s == Path(s).name and s.endswith(".bin") for s in shards):
                raise TypeError(f"split {split!r} lists a shard that is not a .bin file name in this folder")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: invalid ({type(e).__name__}: {e}); {_hint(data_dir)}") from None
    check_splits_disjoint(meta, path)
    for split in ("train", "val"):
        for name in meta["splits"][split]["shards"]:
            if not (data_dir / name).is_file():
                raise DataError(
                    f"{data_dir / name}: shard listed in {META_FILE} is missing; {_hint(data_dir)}"
                )
    check_counts_match_headers(data_dir, meta)
    return meta


def check_splits_disjoint(meta: dict, path: Path) -> None:
    """A shard listed under both train and val would be trained on and then reported as held out."""
    both = sorted(set(meta["splits"]["train"]["shards"]) & set(meta["splits"]["val"]["shards"]))
    if both:
        raise DataError(
            f"{path}: {', '.join(both)} is listed under both train and val: the validation loss would "
            "be measured on training data; the splits must not share a shard"
        )


def check_counts_match_headers(data_dir: Path, meta: dict) -> None:
    """The shard headers are the truth (they are what is read); a meta.json whose token counts
    disagree with them was edited or belongs to other shards, and every count derived from it is wrong."""
    for split in ("train", "val"):
        info = meta["splits"][split]
        found = sum(read_header(Path(data_dir) / name) for name in info["shards"])
        if found != info["tokens"]:
            raise DataError(
                f"{Path(data_dir) / META_FILE}: says the {split} split holds {info['tokens']:,} tokens, "
                f"its shards' headers hold {found:,} (shards replaced or meta.json edited?); "
                f"{_hint(data_dir)}"
            )


def shard_paths(data_dir: Path, split: str, meta: dict | None = None) -> list[Path]:
    """The shard files of `split` exactly as `meta.json` lists them."""
    meta = meta if meta is not None else load_meta(data_dir)
    return [Path(data_dir) / name for name in meta["splits"][split]["shards"]]


_SHARD_NAME = re.compile(r".+_(train|val)_\d{6}\.bin")
_TOKENIZER_FILE = "tokenizer.json"  # data/tokenizers.py TOKENIZER_FILE (not imported: it loads tiktoken)


def foreign_entries(data_dir: Path) -> list[str]:
    """Entries of `data_dir` that a prepared folder of ours does not hold (every entry when its
    meta.json is not a speedrun-shards one). `prepare` replaces a folder only when there are none,
    so a user's folder that happens to hold a meta.json, or their notes beside the shards, is never
    deleted. A `.cache/huggingface` folder is ours: Hub downloads leave it."""
    data_dir = Path(data_dir)
    entries = sorted(p.name for p in data_dir.iterdir())
    try:
        meta = json.loads((data_dir / META_FILE).read_text(encoding="utf-8"))
        ours = isinstance(meta, dict) and meta.get("format") == META_FORMAT
    except (OSError, ValueError):
        ours = False
    if not ours:
        return entries

    def is_ours(name: str) -> bool:
        path = data_dir / name
        if name == ".cache":
            return path.is_dir() and {p.name for p in path.iterdir()} <= {"huggingface"}
        return path.is_file() and (name in (META_FILE, _TOKENIZER_FILE) or bool(_SHARD_NAME.fullmatch(name)))

    return [name for name in entries if not is_ours(name)]
