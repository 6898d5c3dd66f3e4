"""Shared fixtures: a tiny prepared dataset and the overrides that shrink any recipe to seconds on CPU."""

import json
import os
from pathlib import Path

import pytest

# One thread per process: tests run beside other processes on 2 cores, and oversubscribed OpenMP
# threads make torch many times slower. Child processes (CLI, torchrun) inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")

TINY = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "model.max_seq_len=64",
    "model.vocab_size=512",
    "data.tokenizer=bpe:512",
    "train.seq_len=64",
    "train.micro_batch_tokens=512",
    "train.global_batch_tokens=1024",
    "train.steps=30",
    "train.warmdown_steps=10",
    "train.val_every=10",
    "train.val_tokens=2048",
    "train.timing_warmup_steps=2",
    "optim.muon_lr=0.05",
    "optim.embed_lr=0.1",
    "optim.head_lr=0.02",
]


@pytest.fixture(scope="session")
def text_data(tmp_path_factory) -> Path:
    """A small bpe:512 dataset prepared from a slice of the bundled corpus written as a .jsonl file."""
    from speedrun.data.prepare import prepare
    from speedrun.data.sources import iter_documents

    root = tmp_path_factory.mktemp("text")
    docs = [d for _, d in zip(range(600), iter_documents("wiki-vital"), strict=False)]
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return prepare(f"text:{src}", "bpe:512", root / "shards", log=lambda *_: None)
