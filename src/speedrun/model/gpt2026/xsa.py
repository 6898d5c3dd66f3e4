"""Gated XSA (record #82, 2026-04-29, PR #264; arXiv 2603.09078): after the attention, each head's
output y loses a learned share of its component along that head's own value direction v̂,
y ← y − tanh(α_h)·(y·v̂)v̂, with v the value as attended (value embedding mixed in) and α per head,
zero at init (tanh 0 = 0: the layer starts as without XSA). #82 ran it on layers 1, 3, 4, 7, 8, 10 (every
unpaired attention layer); #85 on 1, 3, 4, 7 with α from its gate network. Paired layers (#58) have no
per-token v of the head's own and never get it.

#86 (PR #317) rewrote it without the normalize, (y·v)/max(‖v‖², 1e-8)·v: the same value, as
max(‖v‖, 1e-4)² = max(‖v‖², 1e-8); tests/model_refs.xsa_rewritten is that form, tested equal to this
one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speedrun.model.labels import label


class GatedXSA(nn.Module):
    def __init__(self, n_head: int, label_name: str = "scalar"):
        super().__init__()
        self.alpha = label(nn.Parameter(torch.zeros(n_head)), label_name)  # #82: zero (#77's form: lambda)

    def forward(self, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """y, v (B, H, T, D) → y without tanh(α_h) of its component along v̂ (#82's normalize form)."""
        v_hat = F.normalize(v, dim=-1, eps=1e-4)
        along = (y * v_hat).sum(-1, keepdim=True)
        return y - torch.tanh(self.alpha).type_as(y).view(1, -1, 1, 1) * along * v_hat
