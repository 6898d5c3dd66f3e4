"""The records' Newton–Schulz iterations, written once: every script orthogonalizes in the same frame (a tall
matrix is turned wide, normalized, stepped by quintics X ← aX + (bA + cA²)X with A = XXᵀ, turned back) and
differs only in the cast, the normalization and the coefficients. Each function names the scripts whose lines
it transcribes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

#: the (a, b, c) of track 3's train_gpt_simple.py and record #46 (train_gpt_cwd_SOTA.py), 12 steps
TRACK3 = ((2, -1.5, 0.5),) * 12

#: record #38's (2025-09-29_PolarExpress) polar_express coefficients, one triple a step
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def frame(
    G: Tensor, normalize: Callable[[Tensor], Tensor], coeffs: Sequence[tuple[float, float, float]],
    dtype: torch.dtype | None = None,
) -> Tensor:  # fmt: skip
    """G cast to `dtype` (None: as it is), wide, normalized, stepped once per (a, b, c), turned back."""
    X = G if dtype is None else G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = normalize(X)
    for a, b, c in coeffs:
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if tall else X


def by_norm(X: Tensor) -> Tensor:
    """X / (‖X‖_F + 1e-7): every script before #38, and track 3's simple script."""
    return X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)


def by_gram(X: Tensor) -> Tensor:
    """#46's normalization: by the Frobenius norm estimated from the fp32 Gram matrix, √‖XXᵀ‖ ≥ 1e-7."""
    Xf = X.float()
    gram = Xf.mT @ Xf if Xf.size(-2) > Xf.size(-1) else Xf @ Xf.mT
    return X / gram.norm(dim=(-2, -1), keepdim=True).sqrt().clamp_min(1e-7).to(X.dtype)


def record_26(G: Tensor, steps: int) -> Tensor:
    """#26's zeropower_via_newtonschulz5, in G's dtype (its caller casts G to bf16)."""
    return frame(G, by_norm, ((3.4445, -4.7750, 2.0315),) * steps)


def track3_simple(G: Tensor, dtype: torch.dtype | None = torch.bfloat16) -> Tensor:
    """Track 3's zeropower_via_newtonschulz5 (train_gpt_simple.py, and result #5/#37's in G's dtype)."""
    return frame(G, by_norm, TRACK3, dtype)


def record_46(G: Tensor, steps: int = 12) -> Tensor:
    """#46's zeropower_via_newtonschulz5 with its _ns_inner: bf16, normalized by the Gram estimate."""
    return frame(G, by_gram, TRACK3[:steps], torch.bfloat16)


def record_38_polar_express(G: Tensor) -> Tensor:
    """#38's polar_express in fp32 (its Triton XXT / ba_plus_cAA mirror the upper triangle of the symmetric
    products; the same values in exact arithmetic)."""
    return frame(G, lambda X: X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6), POLAR_EXPRESS,
                 torch.float32)  # fmt: skip
