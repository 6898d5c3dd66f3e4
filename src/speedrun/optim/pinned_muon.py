"""Track 3's Muon of record #46 (2026-06-19, PR #328): SOAP-Muon, the radius pin with its radial brake,
the u/w floor per matrix or per row (RowFloor), and cautious weight decay applied after the pin.

Per matrix W with gradient G, each step (``PinnedMuon``; the record's ``Muon.step``)::

    M ← lerp(M, G, 1 − μ);  D ← lerp(G, M, μ)              # Nesterov momentum, as Muon
    D ← SOAP(D)  (optim.muon_soap)                        # rotate into the eigenbases of the EMAs of
                                                          # GGᵀ and GᵀG, divide by √EMA(D̃²), rotate back,
                                                          # keep ‖D‖₄; attn_out blends it by a trust gate
    U ← orthogonalize(D) · √max(1, rows/cols)
    U ← brake(U, W)      (pin)                            # U's outward radial part × 0.5
    U ← floor(U, W)      (optim.muon_uw_floor > 0)        # ‖U‖/‖W‖ lifted to the target, per row with
                                                          # optim.muon_row_floor
    r ← ‖W‖ − lr·⟨U, W⟩/‖W‖;  mask ← [U ⊙ W > 0]
    W ← W − lr·U;  W ← W · r/‖W‖  (pin)                   # the radius moves only by the radial first order
    W ← W · (1 − lr·cwd·mask)  (optim.muon_post_pin_cwd)  # after the pin, so the shape change survives
    SOAP statistics ← G (eigenbases at the first step, then one power-iteration + QR step a step)

‖X‖₄ is the record's ``gram_frobenius_norm_estimate``: √‖XXᵀ‖_F, the Schatten-4 norm. Every rank
computes every matrix's update from the same averaged gradients (replicated state), so results do not
depend on the world size; track 3 counts steps, not seconds. Each function computes in fp32, or in fp64
for fp64 inputs (tests/fidelity/test_pinned_muon.py compares them with the record's lines in fp64).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from speedrun.optim.orthogonalize import NS_COEFFICIENTS, orthogonalize

#: The record's attention-projection trust gate: agreement floor, gradient-alignment floor, and the
#: early floor/cap on the gate, held until step 1,375 and faded out by 1,625 (steps of its 2,900).
TRUST_MIN_AGREE, TRUST_MIN_GRAD_ALIGN = 0.20, 0.0
EARLY_FLOOR, EARLY_CAP, FLOOR_END, FADE_END = 0.45, 0.85, 1375, 1625
RADIAL_OUTWARD = 0.5  # the brake on updates that would grow ‖W‖


def _work(x: Tensor) -> Tensor:
    """x in its working precision: fp32, or fp64 when it is fp64."""
    return x.double() if x.dtype == torch.float64 else x.float()


def schatten4(x: Tensor, eps: float = 1e-10) -> Tensor:
    """√‖XXᵀ‖_F over the smaller Gram matrix, at least eps (the record's norm of every blend and rescale)."""
    x = _work(x)
    gram = x.mT @ x if x.size(-2) > x.size(-1) else x @ x.mT
    return torch.linalg.matrix_norm(gram, keepdim=False).sqrt().clamp_min(eps)


def cosine(a: Tensor, b: Tensor, eps: float = 1e-8) -> Tensor:
    a, b = _work(a), _work(b)
    return (a * b).sum() / (a.norm() * b.norm()).clamp_min(eps)


# ---------------------------------------------------------------- SOAP


def soap_state(p: Tensor) -> dict[str, Any]:
    """Empty SOAP statistics of a (rows, cols) matrix; no basis until the first observed gradient."""
    rows, cols = p.shape
    dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
    z = dict(dtype=dtype, device=p.device)
    return dict(
        exp_avg_sq=torch.zeros(rows, cols, **z),
        row_gg=torch.zeros(rows, rows, **z),
        col_gg=torch.zeros(cols, cols, **z),
        q_row=torch.empty(0, **z),  # empty: no basis yet
        q_col=torch.empty(0, **z),
        soap_step=0,
    )


def soap_precondition(d: Tensor, state: dict[str, Any], beta2: float, eps: float = 1e-8) -> Tensor:
    """D in the eigenbases, divided by the root of its running second moment there, rotated back and
    rescaled to ‖D‖₄; D itself before the first basis. Updates the second moment."""
    if state["q_row"].numel() == 0:
        return d
    q_row, q_col = state["q_row"], state["q_col"]
    dw = _work(d)
    rotated = q_row.T @ dw @ q_col
    state["exp_avg_sq"].mul_(beta2).add_(rotated.square(), alpha=1 - beta2)
    out = q_row @ (rotated / state["exp_avg_sq"].clamp_min(eps * eps).sqrt()) @ q_col.T
    out.mul_(schatten4(dw, eps) / schatten4(out, eps))
    return out.to(d.dtype)


def _eigenbasis(gg: Tensor) -> Tensor:
    """Eigenvectors of a symmetric matrix, largest eigenvalue first."""
    _, q = torch.linalg.eigh(gg + 1e-30 * torch.eye(gg.size(0), dtype=gg.dtype, device=gg.device))
    return q.flip(1)


def _refine(gg: Tensor, q: Tensor, exp_avg_sq: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """One power-iteration step of the basis q of gg (columns sorted by their Rayleigh quotients first,
    the second moment's `dim` permuted alike) and a QR to orthonormalize it."""
    order = torch.argsort(torch.diag(q.T @ gg @ q), descending=True)
    q, _ = torch.linalg.qr(gg @ q[:, order])
    return q, exp_avg_sq.index_select(dim, order)


def soap_observe(g: Tensor, state: dict[str, Any], beta2: float, every: int = 1) -> None:
    """Fold the gradient into the EMAs of GGᵀ and GᵀG; the first call sets the bases by eigh, every
    `every`-th later one refines them (``_refine``)."""
    gw = _work(g)
    state["row_gg"].lerp_(gw @ gw.T, 1 - beta2)
    state["col_gg"].lerp_(gw.T @ gw, 1 - beta2)
    if state["q_row"].numel() == 0:
        state["q_row"], state["q_col"] = _eigenbasis(state["row_gg"]), _eigenbasis(state["col_gg"])
    elif state["soap_step"] > 0 and state["soap_step"] % every == 0:
        state["q_row"], v = _refine(state["row_gg"], state["q_row"], state["exp_avg_sq"], 0)
        state["q_col"], state["exp_avg_sq"] = _refine(state["col_gg"], state["q_col"], v, 1)
    state["soap_step"] += 1


def trust_gate(raw: Tensor, soap: Tensor, g: Tensor, step: int, eps: float = 1e-8) -> Tensor:
    """How far the attention output's update follows SOAP: the product of SOAP's agreement with the raw
    momentum and its gradient alignment relative to the raw one's, each clamped to [0, 1], then
    clamped to [0.45, 0.85] until step 1,375, the floor fading to 0 by step 1,625."""
    raw_g, soap_g, soap_raw = cosine(raw, g, eps), cosine(soap, g, eps), cosine(soap, raw, eps)
    agree = ((soap_raw - TRUST_MIN_AGREE) / (1 - TRUST_MIN_AGREE)).clamp(0, 1)
    align = ((soap_g - TRUST_MIN_GRAD_ALIGN) / (raw_g - TRUST_MIN_GRAD_ALIGN).clamp_min(eps)).clamp(0, 1)
    if step < FLOOR_END:
        floor = EARLY_FLOOR
    elif step >= FADE_END:
        floor = 0.0
    else:
        floor = EARLY_FLOOR * (FADE_END - step) / (FADE_END - FLOOR_END)
    return (agree * align).clamp(0, 1).clamp(min=floor, max=EARLY_CAP if step < FADE_END else 1.0)


def blend(raw: Tensor, soap: Tensor, gate: Tensor, eps: float = 1e-8) -> Tensor:
    """raw + gate·(soap − raw), rescaled to ‖raw‖₄."""
    mixed = raw + (soap - raw) * gate.to(raw.dtype)
    return (mixed * (schatten4(raw, eps) / schatten4(mixed, eps)).to(mixed.dtype)).to(raw.dtype)


# ---------------------------------------------------------------- the pin, the floor, the decay


def radial_brake(u: Tensor, p: Tensor, eps: float = 1e-12) -> Tensor:
    """U with its component along W halved where the step −lr·U would move W outward (⟨U, W⟩ < 0)."""
    uw, pw = _work(u), _work(p)
    coeff = (uw * pw).sum() / (pw * pw).sum().clamp_min(eps)
    radial = coeff * pw
    scale = torch.where(coeff < 0, uw.new_tensor(RADIAL_OUTWARD), uw.new_tensor(1.0))
    return (uw - radial + scale * radial).to(u.dtype)


def uw_floor(u: Tensor, p: Tensor, target: float, rows: bool) -> Tensor:
    """U scaled up so that ‖U‖/‖W‖ >= target: the whole matrix, or each output row on its own (RowFloor)."""
    uw, pw = _work(u), _work(p)
    if rows:
        ratio = (
            target
            * pw.norm(dim=1, keepdim=True).clamp_min(1e-8)
            / uw.norm(dim=1, keepdim=True).clamp_min(1e-8)
        )
        return (uw * ratio.clamp(min=1.0)).to(u.dtype)
    p_norm, u_norm = pw.norm().clamp_min(1e-8), uw.norm().clamp_min(1e-8)
    scale = torch.where(u_norm / p_norm < target, target * p_norm / u_norm, torch.ones_like(p_norm))
    return u * scale.to(u.dtype)


@torch.no_grad()
def pinned_step(p: Tensor, u: Tensor, lr: float, pin: bool, cwd: float, eps: float = 1e-8) -> None:
    """W ← W − lr·U; with `pin`, W rescaled to the radius the radial part of the step alone gives;
    with `cwd`, then W ← W·(1 − lr·cwd) where U and W share a sign (the step already shrinks |W|)."""
    pw, uw = _work(p), _work(u)
    before = pw.norm().clamp_min(eps)
    target = (before - lr * (uw * pw).sum() / before).clamp_min(eps)
    mask = (uw * pw > 0).to(p.dtype) if cwd > 0 else None
    p.add_(u, alpha=-lr)
    if pin:
        p.mul_((target / _work(p).norm().clamp_min(eps)).to(p.dtype))
    if mask is not None:
        p.mul_(1.0 - (lr * cwd) * mask)


@torch.no_grad()
def hyperball_step(p: Tensor, u: Tensor, lr: float, eps: float = 1e-10) -> None:
    """MuonH (track 3 per-optimizer result #5, PR #267): a step of length lr·‖W‖ along U, then W back on
    its sphere: W ← (W − lr·‖W‖·U/‖U‖)·‖W‖/‖that‖. ‖W‖ never changes (no decay needed)."""
    pw, uw = _work(p), _work(u)
    p_norm = pw.norm()
    new = pw - lr * uw * p_norm / uw.norm().clamp_min(eps)
    p.copy_((new / new.norm().clamp_min(eps) * p_norm).to(p.dtype))


# ---------------------------------------------------------------- the optimizer


class PinnedMuon(torch.optim.Optimizer):
    """Muon with #46's switches, one matrix at a time (``params``: param groups of 2-D matrices; a
    group's ``gate`` is "trust" for attention outputs, "blend" for Q/K/V, "none" for the MLP, as the
    record treats them under SOAP). Hyperparameters are read from the group every step."""

    def __init__(
        self,
        params: list[dict[str, Any]],
        lr: float,
        momentum: float = 0.95,
        soap: bool = False,
        soap_beta2: float = 0.9,
        uw_floor: float = 0.0,
        row_floor: bool = False,
        pin: bool = False,
        cwd: float = 0.0,
        weight_decay: float = 0.0,
        backend: str = "newton_schulz",
        ns_steps: int = 5,
        ns_form: str = "fused",
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_dtype: torch.dtype = torch.bfloat16,
        hyperball: bool = False,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, soap=soap, soap_beta2=soap_beta2, uw_floor=uw_floor)
        defaults |= dict(hyperball=hyperball)
        defaults |= dict(row_floor=row_floor, pin=pin, cwd=cwd, weight_decay=weight_decay, gate="none")
        defaults |= dict(backend=backend, ns_steps=ns_steps, ns_form=ns_form, ns_coefficients=ns_coefficients)
        self.ns_dtype = ns_dtype
        super().__init__(params, defaults)
        for group in self.param_groups:
            assert all(p.ndim == 2 for p in group["params"]), "PinnedMuon takes 2-D matrices"
            assert group["gate"] in ("none", "blend", "trust"), group["gate"]
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            mu, lr = group["momentum"], group["lr"]
            for p in group["params"]:
                g = p.grad
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                    if group["soap"]:
                        state.update(soap_state(p))
                state["momentum"].lerp_(g, 1 - mu)
                d = g.lerp(state["momentum"], mu)
                if group["soap"]:
                    d = self._soap(d, g, state, group)
                ns = (group["backend"], group["ns_steps"], group["ns_form"], self.ns_dtype)
                u = orthogonalize(d, *ns, coefficients=group["ns_coefficients"])
                u = u * math.sqrt(max(1.0, p.size(0) / p.size(1)))
                if group["pin"]:
                    u = radial_brake(u, p)
                if group["uw_floor"] > 0:
                    u = uw_floor(u, p, group["uw_floor"], group["row_floor"])
                if group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                if group["hyperball"]:  # MuonH: the step's length and ‖W‖ set by the weight itself
                    hyperball_step(p, u.to(p.dtype), lr)
                else:
                    pinned_step(p, u.to(p.dtype), lr, group["pin"], group["cwd"])
                if group["soap"]:
                    soap_observe(g, state, group["soap_beta2"])
        self.steps += 1

    def _soap(self, d: Tensor, g: Tensor, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        s = soap_precondition(d, state, group["soap_beta2"])
        if group["gate"] == "none":
            return s
        gate = (
            trust_gate(d, s, g, self.steps)
            if group["gate"] == "trust"
            else d.new_ones((), dtype=torch.float32)
        )
        return blend(d, s, gate)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["steps"] = self.steps
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.steps = state_dict.pop("steps", 0)
        super().load_state_dict(state_dict)
