"""Paired-head attention (record #58, 2026-01-07, PR #191; on layers 0, 2, 5, 9 through #65): heads
share attention in pairs. The record's views of (T, H, D) tensors as (2T, H/2, D) interleave head h of
token t at position 2t + h // (H/2), head slot h mod (H/2): the pairs are heads p and p + H/2 (adjacent
heads only with 2 heads), attended causally as one sequence twice as long, with the documents' bounds
doubled (`cu_seqlens` x2) and the same window, now counted in positions (half as many tokens). A query
of a pair sees both heads' keys of earlier tokens (the second head also the first's key of its own
token). Rotary comes first, on the record's (T, H/2, 2D) view with the YarnPairedHead tables: head h
is rotated as position 2t + h mod 2, whatever its place in the interleaved sequence (the record's
arithmetic, kept). The value embedding and its gate act per head before the interleave (the same
elementwise products); the output is un-interleaved before the attention gate and output projection."""

from __future__ import annotations

from dataclasses import replace

import torch

from speedrun.model.attention import MaskSpec
from speedrun.model.layers import Rotary


def interleave(t: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) → (B, H/2, 2T, D): [b, p, 2t + s] = t[b, s·H/2 + p, t] (the record's reshape)."""
    B, H, T, D = t.shape
    return t.view(B, 2, H // 2, T, D).permute(0, 2, 3, 1, 4).reshape(B, H // 2, 2 * T, D)


def deinterleave(y: torch.Tensor) -> torch.Tensor:
    """The inverse of `interleave`: (B, H/2, 2T, D) → (B, H, T, D)."""
    B, P, T2, D = y.shape
    return y.view(B, P, T2 // 2, 2, D).permute(0, 3, 1, 2, 4).reshape(B, 2 * P, T2 // 2, D)


def rotate(rotary: Rotary, x: torch.Tensor, start: int) -> torch.Tensor:
    """x (B, H, T, D) at tokens start.. rotated as the record's paired tables do: head h as position
    2t + h mod 2 (its (T, H/2, 2D) view puts head 2p at angle 2t and head 2p + 1 at 2t + 1)."""
    B, H, T, D = x.shape
    adjacent = x.view(B, H // 2, 2, T, D).transpose(2, 3).reshape(B, H // 2, 2 * T, D)  # 2p, 2p+1 → 2t, 2t+1
    rotated = rotary(adjacent, 2 * start)
    return rotated.view(B, H // 2, T, 2, D).transpose(2, 3).reshape(B, H, T, D)


def paired_spec(spec: MaskSpec) -> MaskSpec:
    """A layer's mask over the interleaved sequence: each token's document twice, the same window."""
    docs = spec.doc_ids.repeat_interleave(2, dim=1) if spec.doc_ids is not None else None
    return replace(spec, doc_ids=docs)
