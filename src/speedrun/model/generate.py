"""Text generation from a GPT with KV-cached decoding, streamed: every sample starts after the
end-of-text token and ends at the model's own or after `max_tokens`. Used by `speedrun sample` and by
the loop's `train.sample_every`, hence with the model."""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

import torch

from speedrun.model.kv_cache import generate

if TYPE_CHECKING:
    from speedrun.data.tokenizers import Tokenizer


def prompt_ids(tokenizer: Tokenizer, prompt: str, device: torch.device | str) -> torch.Tensor:
    """(1, T) ids: end-of-text (the document start the model trained with), then the prompt's tokens."""
    return torch.tensor([[tokenizer.eot_id, *tokenizer.encode(prompt)]], device=device)


def stream_sample(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    max_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
    out: TextIO | None = None,
) -> str:
    """Generate one continuation of `prompt`, writing text to `out` as soon as it decodes; returns it.
    A token that ends inside a multi-byte character is held back until the character is complete."""
    device = next(model.parameters()).device
    ids: list[int] = []
    shown = ""
    prompt_tokens = prompt_ids(tokenizer, prompt, device)
    for nxt in generate(model, prompt_tokens, max_tokens, temperature, top_k, generator):
        token = int(nxt[0])
        if token == tokenizer.eot_id:
            break
        ids.append(token)
        text = tokenizer.decode(ids)
        if out is not None and not text.endswith("\ufffd"):
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    text = tokenizer.decode(ids)
    if out is not None and len(text) > len(shown):
        out.write(text[len(shown) :])
    return text


#: Fixed prompts for `train.sample_every`: the same text at every log point shows what changed.
DEFAULT_SAMPLE_PROMPTS = ["The history of", "In mathematics,"]


def sample_during_training(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    prompts: list[str],
    max_tokens: int = 48,
) -> list[str]:
    """One greedy continuation per prompt (so successive log points are comparable). `model` is the bare
    GPT (not compiled, not DDP-wrapped); its train/eval mode is restored."""
    was_training = model.training
    model.eval()
    try:
        return [stream_sample(model, tokenizer, p, max_tokens, 0.0, None, None) for p in prompts]
    finally:
        model.train(was_training)
