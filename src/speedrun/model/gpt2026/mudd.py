"""MUDD: multiway dynamic dense connections on the last layer and before the final norm (record #81,
2026-04-22, PR #259 v3, `records/track_1_short/2026-04-22_MuddFormer`; arXiv 2502.12170), as the
repository's train_gpt.py runs it from #81 through #89 (`init_mudd`, `forward_mudd` and the lines of
`GPT.forward` that read `mu`).

Two small GELU MLPs read the residual stream and give per-token coefficients, `mu = (W2·gelu(W1·x) + b)·0.1`
(W1 (64, d) kaiming-uniform, W2 zero, so at step 0 every coefficient is its bias times 0.1):

- at the start of the last layer, from its input x (the output of the layer before, "h9"), 14 coefficients:
  V gets `mu0·c0 + mu1·h + mu2·x` added (with the value embedding scaled by `mu6`/`mu7`, one per half of the
  heads, instead of the layer's sigmoid gate); the stream becomes `(1 + mu5)·x + mu3·c0 + mu4·h`; the
  attention sublayer is `x ← mu8·x + mu9·attn + mu10·c0 + mu11·bigram`, the MLP's `x ← mu12·x + mu13·mlp`
  (the per-sublayer lambdas of #77 made per token; biases start them at the record's static values);
- before the final norm, from the last layer's output, 5 coefficients:
  `x ← x + mu0·c0 + mu1·h + mu2·x9 + mu3·ve0 + mu4·s`, with mu1's bias at −0.5: #40's backout (x − 0.5·h).

c0 is the stream entering layer 0 (after #77's first bigram share), h and s the outputs of the layers
`model.mudd_sources = [h, s]` names (record [7, 3]), x9 the last layer's input, ve0 value-embedding table 0.
Trained by Adam at 0.25× the Adam LR, betas (0.9, 0.99); the biases without weight decay.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from speedrun.model.labels import label

HIDDEN = 64  # the MLPs' width
SCALE = 0.1  # `_mudd_scale`: coefficients = (W2·gelu(W1·x) + b)·SCALE
LAYER_COEFS, FINAL_COEFS = 14, 5


def bias_init(resid_init: float) -> torch.Tensor:
    """The record's b (2, 14) in the pre-scaled domain: the last layer's VE gate lanes at 2, its resid
    lambdas at √resid_init (#77's per-sublayer √1.1), its post lambdas at 1, its bigram share at 0.05, its
    x0 share at 0; before the final norm, the backout −0.5 on h."""
    b = torch.zeros(2, LAYER_COEFS)
    b[0, 6] = b[0, 7] = 2.0 / SCALE
    b[0, 8] = b[0, 12] = resid_init**0.5 / SCALE
    b[0, 9] = b[0, 13] = 1.0 / SCALE
    b[0, 11] = 0.05 / SCALE
    b[1, 1] = -0.5 / SCALE
    return b


class Mudd(nn.Module):
    """The two coefficient MLPs, stacked as the record's `mudd_w1`, `mudd_w2`, `mudd_b2`."""

    def __init__(self, dim: int, n_head: int, resid_init: float):
        super().__init__()
        self.n_head = n_head
        self.w1 = label(nn.Parameter(torch.empty(2, HIDDEN, dim)), "mudd")
        self.w2 = label(nn.Parameter(torch.zeros(2, LAYER_COEFS, HIDDEN)), "mudd")
        self.b2 = label(nn.Parameter(bias_init(resid_init)), "mudd_bias")
        self.resid_init = resid_init
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W1 as nn.Linear's default (kaiming-uniform, a = √5), W2 zero, b the record's values."""
        for j in range(2):
            nn.init.kaiming_uniform_(self.w1.data[j], a=math.sqrt(5))
        nn.init.zeros_(self.w2)
        with torch.no_grad():
            self.b2.copy_(bias_init(self.resid_init))

    def coefs(self, x: torch.Tensor, which: int, n: int) -> list[torch.Tensor]:
        """x (B, T, C) → n coefficients (B, T, 1) of MLP `which` (0 the last layer's, 1 the final)."""
        h = F.gelu(F.linear(x, self.w1[which].type_as(x)))
        mu = (F.linear(h, self.w2[which, :n].type_as(x)) + self.b2[which, :n].type_as(x)) * SCALE
        return list(mu.split(1, dim=-1))

    def enter_last(
        self, x: torch.Tensor, c0: torch.Tensor, h: torch.Tensor, ve: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """At the start of the last layer (x its input): (the stream recombined, what V gets added
        (B, T, C): the value embedding ve scaled per half of the heads plus the MUDD mix, the 14 mu)."""
        mu = self.coefs(x, 0, LAYER_COEFS)
        B, T, C = x.shape
        H = self.n_head
        v_mix = mu[0] * c0 + mu[1] * h + mu[2] * x
        gate = torch.cat([mu[6], mu[7]], dim=-1).repeat_interleave(H // 2, dim=-1).unsqueeze(-1)
        extra = gate * ve.view(B, T, H, C // H).type_as(x) + v_mix.view(B, T, H, C // H)
        return (1 + mu[5]) * x + mu[3] * c0 + mu[4] * h, extra.view(B, T, C), mu

    def final(self, x: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
        """Before the final norm: x plus the 5 coefficients times [c0, h, x9, ve0, s]."""
        mu = self.coefs(x, 1, FINAL_COEFS)
        for m, src in zip(mu, sources, strict=True):
            x = x + m * src.type_as(x)
        return x
