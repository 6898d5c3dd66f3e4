"""Which keys each gpt2026 layer sees: documents (always), and its window, long (L) or short (S).

Two ways in: packed documents with `cu_seqlens` and Python-int windows set per stage (#29 on, varlen:
the `Packed` contexts), or #26's document mask with a 0-d tensor window that grows every step
(`mask_specs`, which cached decoding also uses for varlen models, with the varlen semantics). #58's
paired layers see their documents doubled. The stage hook `apply_schedule` writes a step's windows,
YaRN and MTP weights."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from speedrun.config.gpt2026 import attention_scale, qk_width
from speedrun.model.attention import BLOCK_SIZE, MaskSpec, document_ids, short_window
from speedrun.model.contexts import near_keys
from speedrun.model.flops import StepWindows
from speedrun.model.gpt2026.attention import paired_spec
from speedrun.model.gpt2026.attention_tiers import doc_ids_from_cu, varlen_attention
from speedrun.model.gpt2026.head import write_weights
from speedrun.model.gpt2026.yarn import rotary_tables, yarn_after

# The windows of the variable-length attention path (#29 on, gpt2026): a batch row packs documents,
# their bounds come as `cu_seqlens` from the document loader, and every attention layer calls
# attention_tiers.varlen_attention (FA3 / Flex / blocked SDPA by hardware) with its own window
# (model/gpt2026/windows.py). This module holds the window state a stage sets, and YaRN's updates.
#
# Windows are Python ints (the varlen kernels take them so), set per stage by `set_stage`: a layer marked
# L in `model.windows` takes the long window, S the short one. A stage gives them in 128-token
# blocks as the records do, and the records pass `window_size=(blocks·128, 0)` to FA3, which sees keys
# up to blocks·128 tokens back inclusive: `blocks·128 + 1` in our rule (a key is visible while q − k <
# window). Without stages the windows are `model.window` (long) and half of it (short).


@functools.cache
def windows_of(short: int, long: int, max_doc_len: int) -> StepWindows:
    """What the varlen layers use now (windows in tokens, 0 = none; the longest training document, FA3's
    `max_seqlen`, 0 = the row length), one object per value: compiled graphs guard on the object the
    forward reads, so a stage that comes back (after the warm-up, after a resume) finds its graph again."""
    return StepWindows(short, long, max_doc_len)


def initial_windows(window: int) -> StepWindows:
    """Before any stage: `model.attn.window` for long layers and half of it for short ones."""
    return windows_of(max(1, window // 2) if window > 0 else 0, max(0, window), 0)


def blocks_to_tokens(blocks: int) -> int:
    """A record's window of `blocks` blocks (FA3 `window_size=(blocks·128, 0)`, inclusive) in our rule."""
    return blocks * BLOCK_SIZE + 1


def set_stage(
    model: torch.nn.Module,
    short: int,
    long: int,
    max_doc_len: int,
    yarn: tuple[int, ...],
    yarn_short: tuple[int, ...] = (),
) -> None:
    """Apply a stage's windows (blocks), the longest stretch a query attends within (`max_doc_len`: the
    document cut, #92: its attention segment) and, with YaRN, the rotary tables and attention scales after
    the long windows `yarn` (blocks, in order; #92's narrow layers: after the short ones, `yarn_short`).
    Idempotent: the tables are rebuilt only when a history changed."""
    model.varlen_windows = windows_of(blocks_to_tokens(short), blocks_to_tokens(long), max_doc_len)
    if yarn and (yarn, yarn_short) != getattr(model, "yarn_windows", None):
        short_tokens = [b * BLOCK_SIZE for b in yarn_short] if yarn_short else None
        apply_yarn(model, [b * BLOCK_SIZE for b in yarn], short_tokens)
        model.yarn_windows = (yarn, yarn_short)


def apply_yarn(model: torch.nn.Module, windows: list[int], short_windows: list[int] | None = None) -> None:
    """Rewrite the model's rotary tables (in place: compiled graphs keep reading them) and every layer's
    attention scale for a long window that went through `windows` (tokens), as #31: the scale starts at
    `model.attn.scale` (#344: times √(D/Dqk)) and the half-truncated frequencies at 1 … 1/1024. #92's narrow
    layers have their own table (the turning half of those frequencies) and scale (model.attn.narrow_scale),
    rescaled by the short windows `short_windows` instead."""
    cfg = model.cfg
    attns = [b.attn for b in model.blocks if b.attn is not None]
    chains = (
        ([a for a in attns if not a.narrow_qk], windows, attention_scale(cfg)),
        ([a for a in attns if a.narrow_qk], short_windows or windows[:1], cfg.attn.narrow_scale),
    )
    for group, history, scale0 in chains:
        if not group:
            continue
        rotary = group[0].rotary
        freqs, scale = yarn_after(history, qk_width(cfg), scale0)
        cos, sin = rotary_tables(freqs[: rotary.cos.size(1)], rotary.cos.size(0))  # on the host
        with torch.no_grad():
            rotary.cos.copy_(cos)
            rotary.sin.copy_(sin)
        for attn in group:
            attn.scale = scale


@dataclass(frozen=True)
class Packed:
    """The variable-length kernels' attention context (model/contexts.py): one row (1, T) of packed
    documents bounded by `cu_seqlens`, seen through `window` tokens back (0 = none); a paired layer's
    (#58) bounds and `max_seqlen` come doubled."""

    cu_seqlens: Tensor
    window: int
    max_seqlen: int
    length: int  # positions in the row (T; 2T on a paired layer)
    start: int = 0

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None, kernel: str = "auto") -> Tensor:
        """(1, H, T, D) in and out; the kernels take the packed (T, H, D)."""
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
        y = varlen_attention(q, k, v, self.cu_seqlens, self.window, scale, self.max_seqlen)
        return y.transpose(0, 1)[None]

    def near(self, window: int) -> Tensor:
        """(1, T, T): keys in (t − window, t] of t's document (bounds from `cu_seqlens`)."""
        docs = doc_ids_from_cu(self.cu_seqlens, self.length)[None]
        return near_keys(docs, docs, 0, window)


def contexts(model: torch.nn.Module, idx: Tensor, cu_seqlens: Tensor) -> list[Packed | None]:
    """Per layer, its varlen attention context (None without attention)."""
    assert idx.size(0) == 1, "varlen batches are one packed row"
    w: StepWindows = model.varlen_windows
    T = idx.size(1)
    max_seqlen = min(T, w.max_doc_len) if model.training and w.max_doc_len > 0 else T
    window = {"L": w.long, "S": w.short}
    return [
        (Packed(2 * cu_seqlens, window[s.window], 2 * max_seqlen, 2 * T) if s.paired
         else Packed(cu_seqlens, window[s.window], max_seqlen, T)) if s.attention else None
        for s in model.specs
    ]  # fmt: skip


def mask_specs(model: torch.nn.Module, tokens: Tensor) -> list[MaskSpec]:
    """Per layer, the MaskSpec of a (B, T) sequence: its documents and the layer's current window."""
    cfg = model.cfg
    docs = document_ids(tokens, cfg.eot_id)
    if cfg.attention == "varlen":
        w: StepWindows = model.varlen_windows

        def spec(window: int) -> MaskSpec:
            t = torch.tensor(window, device=tokens.device) if window > 0 else None
            return MaskSpec(docs, t, max_window=window)

        long, short = spec(w.long), spec(w.short)
    else:  # #26: the 0-d window tensor, block-granular
        block = cfg.attn.window_granularity == "block"
        window = model.attn_window if cfg.attn.window > 0 else None
        long = MaskSpec(docs, window, block, cfg.attn.window)
        short = dataclasses.replace(long, window=short_window(window, block)) if window is not None else long
    base = [long if s.window == "L" else short for s in model.specs]
    if not any(s.paired for s in model.specs):
        return base
    doubled = {id(b): paired_spec(b) for b in (long, short)}  # #58: one object per base spec, shared
    return [doubled[id(b)] if s.paired else b for b, s in zip(base, model.specs, strict=True)]


def apply_schedule(model: torch.nn.Module, values) -> None:
    """A step's model values (train/schedule.StepSchedule): the stage's windows and YaRN, MTP weights,
    #88's prefix weight and #92's candidate count, or the tensor window."""
    if values.stage is not None:
        v = values.stage
        set_stage(model, v.short_window, v.long_window, v.attention_len, values.yarn, values.yarn_short)
        if model.mtp_weights is not None:  # #53
            write_weights(model.mtp_weights, v.mtp_weights)
        if model.prefix_weight is not None and v.prefix_weight is not None:  # #88
            model.prefix_weight.fill_(v.prefix_weight)
        if model.sampled_sweep is not None:  # #92: P (a new P is a new graph) and the sweep's start
            model.sampled_candidates = v.candidates
            model.sampled_start.fill_(v.sweep_start % model.sampled_sweep.numel())
    elif values.window > 0:
        model.set_attention_window(values.window)
