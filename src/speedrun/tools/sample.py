"""`speedrun sample`: text from a trained run, streamed to stdout as it is generated (model/generate.py)."""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from speedrun.data.tokenizers import Tokenizer
from speedrun.model.generate import stream_sample


def run_sample(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    n: int,
    max_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    out: TextIO | None = None,
) -> list[str]:
    """`n` samples printed (to stdout by default) one after another, each headed by a separator line."""
    out = out if out is not None else sys.stdout
    generator = torch.Generator().manual_seed(seed)
    texts = []
    for i in range(n):
        if n > 1:
            out.write(f"--- sample {i + 1}/{n} ---\n")
        out.write(prompt)
        texts.append(stream_sample(model, tokenizer, prompt, max_tokens, temperature, top_k, generator, out))
        out.write("\n")
        out.flush()
    return texts
