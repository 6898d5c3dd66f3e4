"""YaRN against today's record's `Yarn` class (train_gpt.py @ f411b3d3), written here from its code,
over the record's window history (long windows 3 → 7 → 11 → 13 blocks, 20 at the final validation)."""

from __future__ import annotations

import math

import pytest
import torch

from speedrun.model.gpt2026.yarn import rotary_tables, yarn_after, yarn_update
from speedrun.model.layers import rotary_frequencies


def half_truncated_freqs(head_dim: int) -> torch.Tensor:
    return rotary_frequencies(head_dim, 10000.0, half_truncated=True)


class RecordYarn:
    def __init__(self, head_dim, max_seq_len):
        self.head_dim, self.max_seq_len = head_dim, max_seq_len
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4, dtype=torch.float32)
        angular_freq = angular_freq.repeat_interleave(2)
        self.angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(head_dim // 2)])
        self.attn_scale = 0.1

    def apply(self, old_window, new_window, alpha=1, beta=32):
        rotations = old_window * self.angular_freq / (2 * torch.pi)
        scaling_factor = old_window / new_window
        interpolation_weight = torch.clamp((rotations - alpha) / (beta - alpha), 0, 1)
        self.angular_freq *= scaling_factor + interpolation_weight * (1 - scaling_factor)
        self.attn_scale *= 0.2 * math.log(new_window / old_window) + 1


WINDOWS = [3 * 128, 7 * 128, 11 * 128, 13 * 128, 20 * 128]


@pytest.mark.parametrize("upto", range(1, len(WINDOWS) + 1))
def test_yarn_follows_todays_record_over_its_window_history(upto):
    ref = RecordYarn(128, 2048)
    for old, new in zip(WINDOWS[: upto - 1], WINDOWS[1:upto], strict=True):
        ref.apply(old, new)
    freqs, scale = yarn_after(WINDOWS[:upto], 128, 0.1)
    assert torch.equal(freqs.repeat_interleave(2), ref.angular_freq)  # the record's interleaved layout
    assert scale == ref.attn_scale


def test_yarn_interpolates_only_slow_frequencies_and_the_scale_grows_with_the_log():
    freqs = half_truncated_freqs(64)
    new, scale = yarn_update(freqs, 0.12, 512, 2048)
    turns = 512 * freqs / (2 * math.pi)
    assert torch.equal(new[turns >= 32], freqs[turns >= 32])  # fast frequencies untouched
    slow = (turns <= 1) & (freqs > 0)
    torch.testing.assert_close(new[slow], freqs[slow] * 0.25)  # slow ones scaled by old/new
    assert scale == pytest.approx(0.12 * (0.2 * math.log(4) + 1))
    assert torch.equal(new[32 // 2 :], torch.zeros(16))  # the unrotated half stays unrotated


def test_half_truncated_tables_rotate_as_the_2025_records():
    """#26's Rotary: cos/sin of t·[freqs, zeros] applied to (x1, x2) = x.chunk(2)."""
    dim, T = 32, 16
    freqs = half_truncated_freqs(dim)
    ref = torch.cat([(1 / 1024) ** torch.linspace(0, 1, steps=dim // 4), torch.zeros(dim // 4)])
    assert torch.equal(freqs, ref)
    cos, sin = rotary_tables(freqs, T)
    theta = torch.einsum("i,j -> ij", torch.arange(T, dtype=torch.float32), ref)
    assert torch.equal(cos, theta.cos()) and torch.equal(sin, theta.sin())
