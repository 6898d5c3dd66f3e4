"""The names a config's data section may give, checked without reading anything: the sources
(`data.source`) and the tokenizers (`data.tokenizer`). Torch- and tiktoken-free, so the config layer
checks a recipe without the data package (tests/unit/test_config_layers.py); the data package reads the same
rules from here.

The hub spec, FineWeb's shard count and the BPE vocabulary bounds are the data package's facts, kept
here because the config checks them first."""

from __future__ import annotations

import re
from dataclasses import dataclass

from speedrun.errors import ConfigError

SOURCES = ("wiki-vital", "text:PATH", "hf:OWNER/NAME[:CONFIG][@SPLIT]", "fineweb10B[:N]")
_SPEC = re.compile(r"hf:([A-Za-z0-9][\w.-]*/[\w.-]+)(?::([^@:/\s]+))?(?:@([\w.-]+))?")
_BPE_NAME = re.compile(r"bpe:(\d+)")
MIN_BPE_VOCAB = 257  # 256 byte tokens + the end-of-text special
MAX_BPE_VOCAB = 65536  # shard version 1 stores uint16 ids


@dataclass(frozen=True)
class HubSource:
    """A dataset repo, its config (None: the default or the only one) and split (default train)."""

    repo_id: str
    config: str | None = None
    split: str = "train"


def parse_hf_source(source: str) -> HubSource:
    """`hf:OWNER/NAME[:CONFIG][@SPLIT]` -> HubSource (ConfigError when malformed)."""
    m = _SPEC.fullmatch(source)
    if not m:
        raise ConfigError(
            f"source {source!r}: expected hf:OWNER/NAME[:CONFIG][@SPLIT], "
            "e.g. hf:HuggingFaceFW/fineweb-edu:sample-10BT"
        )
    return HubSource(m.group(1), m.group(2), m.group(3) or "train")


def parse_bpe_size(name: str) -> int:
    """N from 'bpe:N', range-checked (ConfigError): N counts the end-of-text special too."""
    m = _BPE_NAME.fullmatch(name)
    if not m:
        raise ConfigError(f"unknown tokenizer {name!r}; valid: 'gpt2' or 'bpe:N' (e.g. bpe:4096)")
    n = int(m.group(1))
    if not MIN_BPE_VOCAB <= n <= MAX_BPE_VOCAB:
        raise ConfigError(f"tokenizer {name!r}: N must be between {MIN_BPE_VOCAB} and {MAX_BPE_VOCAB}")
    return n


FINEWEB = "fineweb10B"
FINEWEB_DEFAULT_SHARDS = 9
FINEWEB_MAX_SHARDS = 103  # fineweb_train_000001.bin ... 000103.bin: the full 10B tokens (modded-nanogpt)


def parse_fineweb_source(source: str) -> int | None:
    """Number of train shards for `fineweb10B[:N]`, or None when `source` is not FineWeb."""
    if source == FINEWEB:
        return FINEWEB_DEFAULT_SHARDS
    if not source.startswith(FINEWEB + ":"):
        return None
    raw = source[len(FINEWEB) + 1 :]
    # more than the dataset has would fail only after downloading all of it
    if not raw.isdigit() or not 1 <= int(raw) <= FINEWEB_MAX_SHARDS:
        raise ConfigError(
            f"source {source!r}: N in fineweb10B:N must be a positive integer of at most "
            f"{FINEWEB_MAX_SHARDS} (the dataset has {FINEWEB_MAX_SHARDS} train shards)"
        )
    return int(raw)


def check_source(source: str) -> None:
    """ConfigError unless `source` has the form of a known source; nothing is read or downloaded, so a
    recipe's `data.source` is checked with the rest of the config (a typo was "data folder not found")."""
    if source == "text:":
        raise ConfigError("source 'text:PATH' needs a path, e.g. text:corpus.jsonl")
    if source.startswith("hf:"):
        parse_hf_source(source)
    elif source != "wiki-vital" and not source.startswith("text:") and parse_fineweb_source(source) is None:
        raise ConfigError(f"unknown source {source!r}; valid: {', '.join(SOURCES)}")
