"""The windows of the variable-length attention path (#29 on, gpt2026): a batch row packs documents,
their bounds come as `cu_seqlens` from the document loader, and every attention layer calls
attention_tiers.varlen_attention (FA3 / Flex / blocked SDPA by hardware) with its own window
(model/gpt2026/windows.py). This module holds the window state a stage sets, and YaRN's updates.

Windows are Python ints (the varlen kernels take them so), set per stage by `set_stage`: a layer marked
L in `model.window_pattern` takes the long window, S the short one. A stage gives them in 128-token
blocks as the records do, and the records pass `window_size=(blocks·128, 0)` to FA3, which sees keys
up to blocks·128 tokens back inclusive: `blocks·128 + 1` in our rule (a key is visible while q − k <
window). Without stages the windows are `model.window` (long) and half of it (short).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from speedrun.model.attention import BLOCK_SIZE
from speedrun.model.yarn import rotary_tables, yarn_after


@dataclass(frozen=True)
class VarlenWindows:
    """What the varlen layers use now: windows in tokens (0 = none) and the longest training document
    (FA3's `max_seqlen`; 0 = the row length)."""

    short: int = 0
    long: int = 0
    max_doc_len: int = 0


@functools.cache
def windows_of(short: int, long: int, max_doc_len: int) -> VarlenWindows:
    """One object per value: compiled graphs guard on the object the forward reads, so a stage that
    comes back (after the warm-up, after a resume) finds its graph again."""
    return VarlenWindows(short, long, max_doc_len)


def initial_windows(window: int) -> VarlenWindows:
    """Before any stage: `model.window` for long layers and half of it for short ones."""
    return windows_of(max(1, window // 2) if window > 0 else 0, max(0, window), 0)


def blocks_to_tokens(blocks: int) -> int:
    """A record's window of `blocks` blocks (FA3 `window_size=(blocks·128, 0)`, inclusive) in our rule."""
    return blocks * BLOCK_SIZE + 1


def set_stage(model: torch.nn.Module, short: int, long: int, max_doc_len: int, yarn: tuple[int, ...]) -> None:
    """Apply a stage's windows (blocks) and, with YaRN, the rotary table and attention scale after the
    long windows `yarn` (blocks, in order). Idempotent: the tables are rebuilt only when `yarn` changed."""
    model.varlen_windows = windows_of(blocks_to_tokens(short), blocks_to_tokens(long), max_doc_len)
    if yarn and yarn != getattr(model, "yarn_windows", None):
        apply_yarn(model, [b * BLOCK_SIZE for b in yarn])
        model.yarn_windows = yarn


def apply_yarn(model: torch.nn.Module, windows: list[int]) -> None:
    """Rewrite the model's shared rotary table (in place: compiled graphs keep reading it) and every
    layer's attention scale for a long window that went through `windows` (tokens), as #31: the
    scale starts at `model.attn_scale` and the half-truncated frequencies at 1 … 1/1024."""
    attns = [b.attn for b in model.blocks if b.attn is not None]
    rotary = attns[0].rotary
    head_dim = model.cfg.n_embd // model.cfg.n_head
    freqs, scale = yarn_after(windows, head_dim, model.cfg.attn_scale, layout="half")
    cos, sin = rotary_tables(freqs, rotary.cos.size(0))  # on the host; copied to the buffers' device
    with torch.no_grad():
        rotary.cos.copy_(cos)
        rotary.sin.copy_(sin)
    for attn in attns:
        attn.scale = scale
