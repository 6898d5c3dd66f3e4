"""The one FLOPs count: what a training step computes per token, at the windows it actually uses.

    FLOP/token = 6·N  +  Σ over attention layers 12·d_attn·c

N: the matmul parameters, found by their labels (``labels.MATMULS``) plus the head: forward 2·N, backward
4·N. d_attn = H·(D_qk + D_v)/2 (n_embd when Q/K are as wide as V): PaLM's 12·d·c counts QKᵀ and the
weighted sum, forward and backward. c, the effective context, is the mean over the step's tokens of the
keys each one sees: min(window, position in its document + 1) (causal, inside the layer's window; a
block window counted at its width in tokens). With the documents' lengths known (``doc_lens``) that mean
is exact; otherwise every document is taken at the longest the step allows (the stage's document cut, or
the sequence), an upper bound. A paired layer (#58) sees each document twice, interleaved. Long (L)
and short (S) layers take the step's long and short window (``StepWindows``, from the step's schedule:
stage windows, window warm-up); 0 means no window.

MFU and the FLOPs axis of compare/verify/ablate read this module; the models keep no count of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from speedrun.model.labels import MATMULS, labelled

#: The formula in one line, for `bench`'s output, the dry-run summary and the docs.
FORMULA = (
    "FLOP/token = 6·N_matmul + Σ_layers 12·d_attn·c, "
    "c = mean over tokens of min(window, position in document + 1)"
)


@dataclass(frozen=True)
class StepWindows:
    """What a step's attention sees, in tokens: the long and short windows (0 = none) and the longest
    document (0 = the sequence)."""

    short: int = 0
    long: int = 0
    max_doc_len: int = 0


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer as the count sees it: its window kind ("L"/"S"), d_attn, whether paired."""

    window: str
    width: float
    paired: bool = False


def matmul_params(model: nn.Module) -> int:
    """N: parameters the step multiplies activations by (labels MATMULS), plus the head, tied or not."""
    # an unlabelled parameter counts nothing here; building the optimizer refuses it in one line
    n = sum(p.numel() for _, p, lab in labelled(model) if lab and lab.name in MATMULS)
    return n + model.lm_head.weight.numel()


def keys_seen(window: int, doc_lens: Sequence[int]) -> int:
    """Σ over tokens of min(window, position in document + 1) (window 0: no window), in closed form."""
    total = 0
    for n in doc_lens:
        w = n if window <= 0 else min(window, n)
        total += w * (w + 1) // 2 + (n - w) * w
    return total


def mean_context(
    window: int, seq_len: int, max_doc_len: int = 0, doc_lens: Sequence[int] | None = None
) -> float:
    """c of one layer: exact over `doc_lens`, else over a row of `seq_len` tokens cut into documents of
    `max_doc_len` (0: one document), the most any packing of such documents attends to."""
    if doc_lens is None:
        longest = min(seq_len, max_doc_len) if max_doc_len > 0 else seq_len
        doc_lens = [longest] * (seq_len // longest) + ([seq_len % longest] if seq_len % longest else [])
    tokens = sum(doc_lens)
    assert tokens > 0, doc_lens
    return keys_seen(window, doc_lens) / tokens


def attention_flops(
    layers: Sequence[AttentionLayer],
    windows: StepWindows,
    seq_len: int,
    doc_lens: Sequence[int] | None = None,
) -> float:
    """Σ over `layers` of 12·d_attn·c, at `windows` (see the module's docstring)."""
    total = 0.0
    for layer in layers:
        window = windows.long if layer.window == "L" else windows.short
        if layer.paired:  # #58: the interleaved sequence holds every document twice
            lens = None if doc_lens is None else [2 * n for n in doc_lens]
            c = mean_context(window, 2 * seq_len, 2 * windows.max_doc_len, lens)
        else:
            c = mean_context(window, seq_len, windows.max_doc_len, doc_lens)
        total += 12 * layer.width * c
    return total
