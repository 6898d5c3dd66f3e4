"""#85's lightweight dynamically composable (DC) attention correction, post-only, as plain PyTorch
(record #85, 2026-05-27, PR #315; the record runs it as Triton on layer 10, window 112).

After the layer's attention output y_h (any attention kernel), each head's output gets a correction
built from all heads' attention probabilities, recomputed inside a causal window of W tokens within
the document: with P_h[t, s] = softmax_s(scale·q_h[t]·k_h[s]) over s in (t − W, t] of t's document,

    a[t, s] = Σ_h w1[t, h]·P_h[t, s]          (one mixed attention pattern per query)
    y_h[t] += w2[t, h]·Σ_s a[t, s]·v_h[s]

w1 and w2 are per-token, per-head weights (the record's MUDD gate network produces them; `dc_gate`
RMS-normalizes w1 over the heads). Dense over the keys near each query (`near`, model/contexts.py), in
fp32: what a GPU kernel is tested against; tests/model_refs.dc_correction is the packed-row reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

DC_WINDOW = 112  # the record's window


def dc_gate(w1: Tensor, w2: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
    """(T, H) raw gate outputs → (w1 RMS-normalized over the heads in fp32, w2), in `like`'s dtype."""
    return F.rms_norm(w1.float(), (w1.size(-1),), eps=1.0e-6).type_as(like), w2.type_as(like)


def dc_masked(
    y: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, scale: float, valid: Tensor
) -> Tensor:
    """The correction on the attention's (B, H, T, D) layout: y, q (B, H, Tq, D) of the new positions,
    k, v (B, H, Tk, D) of every position, w1, w2 (B, Tq, H) from `dc_gate`, valid (B, Tq, Tk)
    (the context's `near`, model/contexts.py) → y plus the correction, in y's dtype (probabilities in
    fp32)."""
    scores = torch.einsum("bhtd,bhsd->bhts", q.float(), k.float()) * scale
    probs = scores.masked_fill(~valid[:, None], float("-inf")).softmax(dim=-1)
    mixed = torch.einsum("bth,bhts->bts", w1.float(), probs)
    corr = torch.einsum("bts,bhsd->bhtd", mixed, v.float()) * w2.float().transpose(1, 2)[..., None]
    return (y.float() + corr).to(y.dtype)
