"""Orthogonalization backends for Muon: map a matrix G = U S Vᵀ to (approximately) U Vᵀ.

Every function takes a tensor of shape (..., rows, cols) and orthogonalizes each trailing matrix on
its own (leading dims are a batch), so same-shape matrices can share one batched iteration.

- ``newton_schulz``: the quintic iteration of the speedrun records, in bf16. Its coefficients are
  tuned for speed, not convergence, so singular values land in a band around 1 instead of on 1.
- ``polar_express``: the Polar Express iteration (Amsel, Persson, Musco & Gower, 2025) with one
  coefficient triple per step, as used by modded-nanogpt HEAD; a tighter band for the same cost.
- ``svd_orthogonalize``: exact U Vᵀ in fp32 (fp64 stays fp64); a slow reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from speedrun import ops

Coefficients = tuple[float, float, float]

#: Quintic Newton–Schulz coefficients (a, b, c) of the speedrun records from 2024-10 onwards.
NS_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)

#: Polar Express coefficients, one (a, b, c) per iteration (modded-nanogpt HEAD).
#: Re-derived in tests/unit/test_muon.py with the paper's greedy construction: each step is the odd quintic
#: that best approximates 1 (minimax) on [max(l, 0.02·u), u], starting from [1e-3, 1]; while the
#: 0.02 "cushion" is active the polynomial is rescaled so p(l) + p(u) = 2; every step but the last is
#: then stretched by a safety factor 1.02 (x → x/1.02), the same 1.02 that divides the input norm.
#: The derivation reproduces these numbers to 1e-10.
POLAR_EXPRESS_COEFFICIENTS: tuple[Coefficients, ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

#: Names accepted by ``orthogonalize`` and by ``Muon(backend=...)``.
BACKENDS: tuple[str, ...] = ("newton_schulz", "polar_express", "svd")

#: How ``newton_schulz`` evaluates each step, named by the first record that did it that way. The forms
#: are equal in exact arithmetic; in bf16 each op rounds, so matching a record means matching its ops.
#: fused: X ← aX + (bA + cA²)X with two fused multiply-adds (fewest roundings; our default).
#: 2024-10-10 (the seed and 10-10): X = bf16(G) / (‖G‖ + 1e-7) with the norm taken in G's precision;
#:   A = XXᵀ; B = AX; X = aX + bB + (cA)B.
#: 2024-10-14 (10-14 … 11-08): the same steps, X normalized after the bf16 cast (bf16 norm).
#: 2024-11-10 (11-10 … Sub3Min): bf16 normalization; A = XXᵀ; B = bA + (cA)A; X = aX + BX.
#: 2026-06 (track 3, #44–#46): X divided by its Schatten-4 norm √‖XXᵀ‖_F (fp32, then bf16), 2024-11-10 ops.
NS_FORMS: tuple[str, ...] = ("fused", "2024-10-10", "2024-10-14", "2024-11-10", "2026-06")


@ops.plain_op("gram")
def gram(x: Tensor) -> Tensor:
    """X Xᵀ for a batch (n, rows, cols): symmetric, so a kernel may compute one triangle (speedrun.perf)."""
    return torch.bmm(x, x.mT)


@ops.plain_op("ba_plus_caa")
def ba_plus_caa(a: Tensor, b: float, c: float) -> Tensor:
    """b·A + c·A·A for a batch of symmetric A (n, m, m) (a Gram matrix): the step's polynomial."""
    return torch.baddbmm(a, a, a, beta=b, alpha=c)


def _odd_quintic_iterations(x: Tensor, coefficients: Sequence[Coefficients]) -> Tensor:
    """Apply X ← aX + (bA + cA²)X with A = XXᵀ for each (a, b, c); x is (..., rows, cols), rows <= cols.

    Evaluating (bA + cA²)X instead of bAX + cA²X saves one (rows × rows × cols) matmul per step.
    """
    batch_shape = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])
    for a, b, c in coefficients:
        poly = ba_plus_caa(gram(x), b, c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.reshape(*batch_shape, *x.shape[-2:])


def _wide(g: Tensor) -> tuple[Tensor, bool]:
    """Transpose tall matrices so the Gram matrix XXᵀ is the small one."""
    tall = g.size(-2) > g.size(-1)
    return (g.mT if tall else g), tall


def _check_matrix(g: Tensor) -> None:
    if g.ndim < 2:
        raise ValueError(f"orthogonalization needs a (..., rows, cols) tensor, got shape {tuple(g.shape)}")


def _record_iterations(x: Tensor, coefficients: Coefficients, steps: int, form: str) -> Tensor:
    """The record's own evaluation order, one bf16 rounding per op as its eager code does."""
    a, b, c = coefficients
    batch_shape = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])  # bmm: the kernel `@` uses, without its per-call reshapes
    for _ in range(steps):
        A = gram(x)
        if form == "2024-11-10":
            B = b * A + torch.bmm(c * A, A)
            x = a * x + torch.bmm(B, x)
        else:
            B = torch.bmm(A, x)
            x = a * x + b * B + torch.bmm(c * A, B)
    return x.reshape(*batch_shape, *x.shape[-2:])


def newton_schulz(
    g: Tensor,
    steps: int = 5,
    coefficients: Coefficients = NS_COEFFICIENTS,
    eps: float = 1e-7,
    form: str = "fused",
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Quintic Newton–Schulz in bf16 (or `dtype`: fp32 on CPUs that emulate bf16 ~100x slower); returns
    a tensor of g's shape in that dtype.

    The input is divided by its Frobenius norm (+eps) so every singular value is <= 1, inside the
    polynomial's basin. Band (5 steps): an input singular value σ with σ/‖G‖_F >= 2e-3 comes out in
    [0.68, 1.21] (the exact scalar map gives [0.680, 1.202]; bf16 runs on random and condition-1e6
    GPT-2-shaped matrices measured the same; tests/unit/test_muon.py asserts [0.65, 1.25]). Smaller ones
    are amplified by about a^5 ≈ 490 and stay below the band; no output exceeds 1.21.
    ``form`` (``NS_FORMS``) picks the evaluation order of a record era.
    """
    _check_matrix(g)
    if form not in NS_FORMS:
        raise ValueError(f"unknown Newton-Schulz form {form!r}; choose one of {', '.join(NS_FORMS)}")
    x, tall = _wide(g.to(dtype))
    if form == "2024-10-10":  # the norm of the input in its own precision, then a bf16 division
        x = (x / (torch.linalg.matrix_norm(_wide(g)[0], keepdim=True) + eps)).to(dtype)
    elif form == "2026-06":  # (Σσ⁴)^¼ of the rounded input, from its fp32 (fp64) Gram matrix
        xw = x.double() if x.dtype == torch.float64 else x.float()
        x = x / (xw @ xw.mT).norm(dim=(-2, -1), keepdim=True).sqrt().clamp_min(eps).to(dtype)
        form = "2024-11-10"
    else:
        x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    if form == "fused":
        x = _odd_quintic_iterations(x, [coefficients] * steps)
    else:
        x = _record_iterations(x, coefficients, steps, form)
    return x.mT if tall else x


def polar_express(
    g: Tensor, steps: int = 5, eps: float = 1e-6, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Polar Express in bf16 (or `dtype`) with per-step coefficients; returns a tensor of g's shape.

    The input is divided by 1.02·‖G‖_F + eps (the safety factor the coefficients were built for).
    ``steps`` > 5 repeats the last triple, which is convergent near 1. Band (5 steps): σ with
    σ/‖G‖_F >= 1e-3 comes out in [0.85, 1.15] (exact scalar map [0.847, 1.141]; bf16 runs measured
    [0.851, 1.142]; tests/unit/test_muon.py asserts [0.82, 1.17]).
    """
    _check_matrix(g)
    if steps < 1:
        raise ValueError(f"polar_express needs steps >= 1, got {steps}")
    table = POLAR_EXPRESS_COEFFICIENTS
    coefficients = list(table[:steps]) + [table[-1]] * max(0, steps - len(table))
    x, tall = _wide(g.to(dtype))
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) * 1.02 + eps)
    x = _odd_quintic_iterations(x, coefficients)
    return x.mT if tall else x


def svd_orthogonalize(g: Tensor) -> Tensor:
    """Exact U Vᵀ from the thin SVD, in fp32 (fp64 input stays fp64). Reference, not for speed."""
    _check_matrix(g)
    work = g if g.dtype == torch.float64 else g.float()
    u, _, vh = torch.linalg.svd(work, full_matrices=False)
    return u @ vh


def orthogonalize(
    g: Tensor,
    backend: str = "newton_schulz",
    steps: int = 5,
    ns_form: str = "fused",
    dtype: torch.dtype = torch.bfloat16,
    coefficients: Coefficients = NS_COEFFICIENTS,
) -> Tensor:
    """Dispatch to one of ``BACKENDS``; ``steps`` is ignored by ``svd``, ``ns_form`` and ``coefficients``
    (track 3's baseline: (2, -1.5, 0.5), 12 steps) by all but NS, ``dtype`` (the iterations' precision)
    by ``svd``."""
    if backend == "newton_schulz":
        return newton_schulz(g, steps, coefficients, form=ns_form, dtype=dtype)
    if backend == "polar_express":
        return polar_express(g, steps, dtype=dtype)
    if backend == "svd":
        return svd_orthogonalize(g)
    raise ValueError(f"unknown orthogonalization backend {backend!r}; choose one of {', '.join(BACKENDS)}")
