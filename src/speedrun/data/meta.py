"""A prepared data folder: where it is (`data_dir_for`), its `meta.json` (written last by `write_meta`,
it marks the folder complete; `load_meta` checks it whole) and whether a recipe (`check_fits`) or a
tokenizer (`tokenizer_for_data`) fits it. The one owner of these rules."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from speedrun.atomic import json_object, write_atomic
from speedrun.config.families import model_facts
from speedrun.data.shards import read_header
from speedrun.data.sources import source_slug
from speedrun.errors import DataError

if TYPE_CHECKING:  # tokenizers imports tiktoken: loaded only by the functions that need a tokenizer
    from speedrun.config import Config
    from speedrun.data.tokenizers import Tokenizer

META_FILE = "meta.json"
META_FORMAT = "speedrun-shards"
DATA_FINGERPRINT = "meta sha256 "  # how a run's log.txt `data:` line names meta_fingerprint
META_VERSION = 1


def default_data_dir(source: str, tokenizer: str) -> Path:
    """`data/<source-slug>` for gpt2, `data/<source-slug>-bpe<N>` for bpe:N (relative to the cwd)."""
    from speedrun.config.data import parse_bpe_size

    if tokenizer == "gpt2":
        return Path("data") / source_slug(source)
    return Path("data") / f"{source_slug(source)}-bpe{parse_bpe_size(tokenizer)}"


def data_dir_for(cfg: Config) -> Path:
    """The shard folder of a recipe or run: data.dir, else the default folder of its source and tokenizer."""
    return Path(cfg.data.dir) if cfg.data.dir else default_data_dir(cfg.data.source, cfg.data.tokenizer)


def write_meta(data_dir: Path, source: str, tok: Tokenizer, splits: dict, **extra: object) -> dict:
    """Describe a finished folder of shards in its meta.json (written atomically and last: its presence
    marks the folder complete). `extra`: how the folder was made (seed, split, repo, ...)."""
    meta = {
        "format": META_FORMAT,
        "version": META_VERSION,
        "source": source,
        "tokenizer": tok.name,
        "tokenizer_hash": tok.hash,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        **extra,
        "splits": splits,
    }
    write_atomic(Path(data_dir) / META_FILE, (json.dumps(meta, indent=2) + "\n").encode())
    return meta


def _hint(data_dir: Path) -> str:
    return f"run `speedrun prepare SOURCE --data-dir {data_dir}` (e.g. SOURCE = wiki-vital)"


def load_meta(data_dir: Path) -> dict:
    """Read and validate `data_dir/meta.json`; its presence is what marks a folder as complete."""
    data_dir = Path(data_dir)
    if data_dir.exists() and not data_dir.is_dir():  # (before: "not found", and advice to prepare into it)
        raise DataError(f"{data_dir}: is a file, not a data folder made by speedrun prepare")
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


def meta_fingerprint(meta: dict) -> str:
    """12 hex digits of what the folder's meta.json says of its content (tokenizer hash, shard names and
    token counts; not the source, whose text: path differs between machines holding the same corpus): a
    folder prepared again from other text gets another one. Runs log it (`data:` line) and the tools that
    compare runs refuse runs of different fingerprints (tools/alike.py)."""
    content = {k: v for k, v in meta.items() if k != "source"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:12]


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


def check_fits(meta: dict, cfg: Config, data_dir: Path) -> None:
    """DataError unless the folder's tokenizer, vocabulary and document marker are the recipe's."""
    m = cfg.model
    if meta["tokenizer"] != cfg.data.tokenizer:
        raise DataError(
            f"{data_dir} was tokenized with {meta['tokenizer']} but the recipe asks for "
            f"data.tokenizer={cfg.data.tokenizer}"
        )
    if meta["vocab_size"] != m.vocab_size:
        raise DataError(
            f"{data_dir} has vocab size {meta['vocab_size']} but model.vocab_size is {m.vocab_size}"
        )
    if (model_facts(m).document_mask or m.attention == "varlen") and meta["eot_id"] != m.eot_id:
        raise DataError(f"{data_dir} marks documents with token {meta['eot_id']}, model.eot_id is {m.eot_id}")


def check_tokenizer(meta: dict, tokenizer: Tokenizer, data_dir: Path | None = None) -> None:
    """DataError unless `tokenizer` is the vocabulary the shards were written with: its name, hash and every
    number meta.json copies from it (a model sized by meta.json must match the tokenizer's table)."""
    where = f"{Path(data_dir) / META_FILE}" if data_dir is not None else META_FILE
    if meta.get("tokenizer") != tokenizer.name or meta.get("tokenizer_hash") != tokenizer.hash:
        raise DataError(
            f"{where}: data was tokenized with {meta.get('tokenizer')!r} "
            f"(hash {meta.get('tokenizer_hash')}), "
            f"not {tokenizer.name!r} (hash {tokenizer.hash}); prepare the data again"
        )
    for key in ("vocab_size", "eot_id"):
        if meta.get(key) != getattr(tokenizer, key):
            raise DataError(
                f"{where}: {key} {meta.get(key)!r} is not its tokenizer's ({getattr(tokenizer, key)}, "
                f"{tokenizer.name}); the folder was edited or mixed: prepare the data again"
            )


def tokenizer_for_data(data_dir: Path, meta: dict | None = None) -> Tokenizer:
    """Load the tokenizer `data_dir` was made with and verify its hash against `meta.json`."""
    from speedrun.data.tokenizers import load_tokenizer

    meta = meta if meta is not None else load_meta(data_dir)
    tok = load_tokenizer(meta["tokenizer"], data_dir)
    check_tokenizer(meta, tok, data_dir)
    return tok


_SHARD_NAME = re.compile(r".+_(train|val)_\d{6}\.bin")
_TOKENIZER_FILE = "tokenizer.json"  # data/tokenizers.py TOKENIZER_FILE (not imported: it loads tiktoken)


def is_data_file_name(name: str) -> bool:
    """Whether `name` is one a prepared folder of ours holds: meta.json, tokenizer.json, shards, .cache."""
    return name in (META_FILE, _TOKENIZER_FILE, ".cache") or bool(_SHARD_NAME.fullmatch(name))


def is_prepared_folder(data_dir: Path) -> bool:
    """Whether `data_dir` holds a meta.json of ours (speedrun-shards), not a user's file of that name."""
    return json_object(Path(data_dir) / META_FILE).get("format") == META_FORMAT


def foreign_entries(data_dir: Path) -> list[str]:
    """Entries of `data_dir` that a prepared folder of ours does not hold (all of them without our
    meta.json): `prepare` replaces a folder only when there are none, so a user's files are never deleted."""
    data_dir = Path(data_dir)
    entries = sorted(p.name for p in data_dir.iterdir())
    if not is_prepared_folder(data_dir):
        return entries

    def is_ours(name: str) -> bool:
        path = data_dir / name
        if name == ".cache":
            return path.is_dir() and {p.name for p in path.iterdir()} <= {"huggingface"}
        return path.is_file() and (name in (META_FILE, _TOKENIZER_FILE) or bool(_SHARD_NAME.fullmatch(name)))

    return [name for name in entries if not is_ours(name)]
