"""Track 3 record #46's CGI init (2026-06-19, "v14 CGI Rademacher channel-gain split"): each block's two
RMSNorm gains start at 1 ∓ α·s, s a ±1 sign per channel, so every channel leans towards the attention
or the MLP from step 0 (α = `model.cgi_gain_alpha`, #46: 0.125).

Below layer 6 the signs are Rademacher draws from torch's generator; from layer 6 on, layers come in
pairs (6, 7), (8, 9), …: per head of `head_dim` channels the first layer's signs have their +1 count
pulled halfway to head_dim/2 and are shuffled; the second layer gets the opposite count, shuffled
(antithetic and head-balanced), from a generator seeded by the run's seed and the layer. A lone last
layer of a pair has no partner and its signs are dropped. tests/fidelity/test_cgi_init.py compares with the
record's `headmean_antithetic_pair` and loop.
"""

from __future__ import annotations

import torch
from torch import Tensor

CPU = torch.device("cpu")  # drawn on the host (also while a model is built on the meta device)
PAIR_FROM_LAYER = 6
HEAD_MEAN_SHRINK = 0.5


def _head_signs(plus: int, head_dim: int, gen: torch.Generator) -> Tensor:
    """`plus` ones and head_dim − plus minus ones, in the generator's random order."""
    signs = torch.cat([torch.ones(plus, device=CPU), -torch.ones(head_dim - plus, device=CPU)])
    return signs[torch.randperm(head_dim, generator=gen, device=CPU)]


def antithetic_pair(width: int, head_dim: int, layer: int, seed: int) -> tuple[Tensor, Tensor]:
    """The signs of a pair of layers (the record's `headmean_antithetic_pair`); plain opposite
    Rademacher signs when head_dim does not divide the width."""
    if width % head_dim:
        s0 = torch.randint(0, 2, (width,), dtype=torch.float32, device=CPU) * 2 - 1
        return s0, -s0
    gen = torch.Generator(device=CPU).manual_seed((0xA9170000 + seed * 1009 + layer * 9176) % 2**63)
    first, second = [], []
    for _ in range(width // head_dim):
        draw = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64, device=CPU) * 2 - 1
        plus = int((draw > 0).sum())
        plus = max(0, min(head_dim, round(head_dim / 2 + HEAD_MEAN_SHRINK * (plus - head_dim / 2))))
        first.append(_head_signs(plus, head_dim, gen))
        second.append(_head_signs(head_dim - plus, head_dim, gen))
    return torch.cat(first), torch.cat(second)


def cgi_signs(n_layer: int, width: int, head_dim: int, seed: int) -> list[Tensor]:
    """One ±1 sign vector per layer (fp32), in the record's order of draws."""
    signs, partner = [], None
    for layer in range(n_layer):
        if layer >= PAIR_FROM_LAYER and (layer - PAIR_FROM_LAYER) % 2 == 1:
            s, partner = partner, None
        elif layer >= PAIR_FROM_LAYER:
            s, partner = antithetic_pair(width, head_dim, layer, seed)
        else:
            s = torch.randint(0, 2, (width,), dtype=torch.float32, device=CPU) * 2 - 1
        signs.append(s)
    return signs
