"""How many rows the embeddings and the head have: shared by both families, their summary and the
memory estimate (any model config with vocab_size and pad_vocab_to; padding embeddings is a model fact)."""

from __future__ import annotations

from typing import Any

from speedrun.config.families import model_facts


def padded_vocab(cfg: Any) -> int:
    """Head rows: vocab rounded up to `pad_vocab_to` (a multiple of 128 makes matmuls faster)."""
    m = max(1, cfg.pad_vocab_to)
    return (cfg.vocab_size + m - 1) // m * m


def embedding_rows(cfg: Any) -> int:
    """Token/value embedding rows: padded like the head, or exactly the vocab (Sub3Min)."""
    return padded_vocab(cfg) if model_facts(cfg).pad_embeddings else cfg.vocab_size
