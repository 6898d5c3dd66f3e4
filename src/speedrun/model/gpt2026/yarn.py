"""YaRN for the records' half-truncated RoPE (#31 on): when the long window grows from `old` to `new`
tokens, each frequency is interpolated by its turns over the old window and the attention scale × 0.2·
ln(new/old) + 1 (again for the final validation's window); pure functions of the window history.
Layout "half" pairs dimension i with i + head_dim/2 (2025 `chunk(2)`), "interleaved" 2i with 2i+1."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def half_truncated_freqs(head_dim: int, layout: str = "half") -> Tensor:
    """Angular frequency of each rotated coordinate, (head_dim // 2,) for "half", (head_dim,) for
    "interleaved" (each frequency twice, as the record's tables hold it)."""
    freqs = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4, dtype=torch.float32)
    if layout == "half":
        return torch.cat([freqs, freqs.new_zeros(head_dim // 4)])
    assert layout == "interleaved", layout
    return torch.cat([freqs.repeat_interleave(2), freqs.new_zeros(head_dim // 2)])


def yarn_update(
    freqs: Tensor, attn_scale: float, old_window: int, new_window: int, alpha: float = 1, beta: float = 32
) -> tuple[Tensor, float]:
    """Frequencies and attention scale after the long window grows from `old_window` to `new_window`:
    under `alpha` turns over the old window scaled by old/new, over `beta` kept, linear in between."""
    rotations = old_window * freqs / (2 * torch.pi)
    ratio = old_window / new_window
    weight = torch.clamp((rotations - alpha) / (beta - alpha), 0, 1)
    return freqs * (ratio + weight * (1 - ratio)), attn_scale * (0.2 * math.log(new_window / old_window) + 1)


def yarn_after(
    windows: list[int], head_dim: int, attn_scale: float = 0.1, layout: str = "half"
) -> tuple[Tensor, float]:
    """Frequencies and scale after the long window went through `windows` (tokens, in order); a window
    equal to the previous one changes nothing."""
    freqs = half_truncated_freqs(head_dim, layout)
    for old, new in zip(windows[:-1], windows[1:], strict=True):
        if new != old:
            freqs, attn_scale = yarn_update(freqs, attn_scale, old, new)
    return freqs, attn_scale


def rotary_tables(freqs: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """cos and sin tables (length, len(freqs)) of positions 0 … length-1."""
    theta = torch.outer(torch.arange(length, dtype=torch.float32), freqs)
    return theta.cos(), theta.sin()
