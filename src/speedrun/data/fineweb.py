"""`speedrun prepare fineweb10B[:N]`: fetch modded-nanogpt's pre-tokenized GPT-2 FineWeb shards (default
repo `kjj0/fineweb10B-gpt2`). The one place that uses the network; each file is validated before
`meta.json` is written, last, so an interrupted download never looks complete and a rerun resumes."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from speedrun.atomic import json_object
from speedrun.data.hub import hub_call
from speedrun.data.meta import META_FILE, write_meta
from speedrun.data.shards import open_shard
from speedrun.data.tokenizers import gpt2_tokenizer
from speedrun.errors import ConfigError, DataError

DEFAULT_REPO = "kjj0/fineweb10B-gpt2"
VAL_FILE = "fineweb_val_000000.bin"


def fineweb_file_names(num_train_shards: int) -> list[str]:
    """The val shard, then train shards 1..N (modded-nanogpt's numbering: shard 0 is val)."""
    return [VAL_FILE] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train_shards + 1)]


def _fetch(repo_id: str, name: str, data_dir: Path, endpoint: str | None) -> Path:
    from huggingface_hub import hf_hub_download

    fetch = partial(
        hf_hub_download, repo_id, name, repo_type="dataset", local_dir=data_dir, endpoint=endpoint
    )
    return Path(hub_call(f"download {name}", repo_id, endpoint, fetch))


def _scan(path: Path, vocab_size: int, eot_id: int) -> tuple[int, int]:
    """Validate a shard fully (header, length, id range) and count its documents (eot tokens)."""
    try:
        tokens = open_shard(path, vocab_size=vocab_size)
    except DataError:
        path.unlink(missing_ok=True)  # a corrupt file would otherwise be trusted on the next run
        raise
    block = 1 << 24
    docs = sum(int(np.count_nonzero(tokens[i : i + block] == eot_id)) for i in range(0, len(tokens), block))
    return len(tokens), docs


def download_fineweb(
    num_train_shards: int,
    data_dir: Path,
    repo_id: str = DEFAULT_REPO,
    log: Callable[[str], object] = print,
    endpoint: str | None = None,
) -> Path:
    """Download, validate and describe (meta.json) `num_train_shards` train shards plus the val shard;
    `endpoint` overrides the Hub address (as HF_ENDPOINT does)."""
    if num_train_shards < 1:
        raise ConfigError(f"fineweb10B:N needs N >= 1 train shards, got {num_train_shards}")
    data_dir = Path(data_dir)
    meta_path = data_dir / META_FILE
    if meta_path.is_file():
        old_source = str(json_object(meta_path).get("source", ""))
        if not old_source.startswith("fineweb10B"):
            raise DataError(f"{meta_path}: folder holds other prepared data; choose another --data-dir")
        meta_path.unlink()  # the folder is not complete again until the new meta.json is written
    data_dir.mkdir(parents=True, exist_ok=True)

    tok = gpt2_tokenizer()
    splits: dict[str, dict] = {s: {"tokens": 0, "documents": 0, "shards": []} for s in ("val", "train")}
    for name in fineweb_file_names(num_train_shards):
        log(f"fineweb: {name}")
        path = _fetch(repo_id, name, data_dir, endpoint)
        tokens, docs = _scan(path, tok.vocab_size, tok.eot_id)
        if path.resolve() != (data_dir / name).resolve():
            raise DataError(f"{path}: downloaded to an unexpected place (expected {data_dir / name})")
        entry = splits["val" if name == VAL_FILE else "train"]
        entry["tokens"] += tokens
        entry["documents"] += docs
        entry["shards"].append(name)
    write_meta(data_dir, f"fineweb10B:{num_train_shards}", tok, splits, repo_id=repo_id)
    train, val = splits["train"]["tokens"], splits["val"]["tokens"]
    log(f"fineweb: {train:,} train and {val:,} val tokens in {data_dir}")
    return data_dir
