"""YaRN for the records' half-truncated RoPE (#31 on): when the long window grows from `old` to `new`
tokens, each frequency is interpolated by its turns over the old window and the attention scale × 0.2·
ln(new/old) + 1 (again for the final validation's window); pure functions of the window history.
The frequencies are layers.rotary_frequencies' half-truncated ones, dimension i paired with
i + head_dim/2 (2025 `chunk(2)`; the record's interleaved tables hold each frequency twice, 2i and 2i+1,
and every update is elementwise, so the two layouts carry the same numbers)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from speedrun.model.layers import rotary_frequencies


def yarn_update(
    freqs: Tensor, attn_scale: float, old_window: int, new_window: int, alpha: float = 1, beta: float = 32
) -> tuple[Tensor, float]:
    """Frequencies and attention scale after the long window grows from `old_window` to `new_window`:
    under `alpha` turns over the old window scaled by old/new, over `beta` kept, linear in between."""
    rotations = old_window * freqs / (2 * torch.pi)
    ratio = old_window / new_window
    weight = torch.clamp((rotations - alpha) / (beta - alpha), 0, 1)
    return freqs * (ratio + weight * (1 - ratio)), attn_scale * (0.2 * math.log(new_window / old_window) + 1)


def yarn_after(windows: list[int], head_dim: int, attn_scale: float = 0.1) -> tuple[Tensor, float]:
    """Frequencies and scale after the long window went through `windows` (tokens, in order); a window
    equal to the previous one changes nothing."""
    freqs = rotary_frequencies(head_dim, 10000.0, half_truncated=True)  # the base is unused then
    for old, new in zip(windows[:-1], windows[1:], strict=True):
        if new != old:
            freqs, attn_scale = yarn_update(freqs, attn_scale, old, new)
    return freqs, attn_scale


def rotary_tables(freqs: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """cos and sin tables (length, len(freqs)) of positions 0 … length-1."""
    theta = torch.outer(torch.arange(length, dtype=torch.float32), freqs)
    return theta.cos(), theta.sin()
