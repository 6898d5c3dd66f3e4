"""Mimetic V/O init (record #64, 2026-01-30, PR #214, `mimetic_vo_init`): each attention layer's value
and output projections start near ±√β times the identity, so V·Oᵀ ≈ −βI and a fresh layer already
subtracts a little of its (mixed) input, as trained attention layers tend to. Per head the blocks are
identities; with head_dim · n_head = n_embd that is the whole identity. N(0, noise_std²) noise breaks
the symmetry. Q and K keep their uniform init. #65 branched from #63 without it: a switch
(`model.mimetic_vo_beta`, 0 = off; #64: 0.05).
"""

from __future__ import annotations

import torch

#: #64's noise_std for symmetry breaking
NOISE_STD = 0.01


@torch.no_grad()
def mimetic_vo_init_(v_weight: torch.Tensor, o_weight: torch.Tensor, beta: float) -> None:
    """Overwrite the (d, d) value rows and output projection in place: V = √β·I + noise, O = −√β·I + noise."""
    assert v_weight.shape == o_weight.shape and v_weight.shape[0] == v_weight.shape[1]
    eye = torch.eye(v_weight.shape[0], dtype=v_weight.dtype, device=v_weight.device)
    v_weight.copy_(beta**0.5 * eye + NOISE_STD * torch.randn_like(v_weight))
    o_weight.copy_(-(beta**0.5) * eye + NOISE_STD * torch.randn_like(o_weight))
