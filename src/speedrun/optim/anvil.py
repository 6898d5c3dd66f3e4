"""ANVIL, the matrix optimizer of record #92 (PR #360, "ANVIL2"): NorMuon's sharded table (optim/sharded.py)
with another direction for the matrices and a slower cadence for the value embeddings.

Per matrix, one ANVIL step is (the record's ``anvil_cascade`` and ``anvil_bank_update``)::

    fast ← lerp(fast, g, 1 − β_f);  slow ← lerp(slow, g, 1 − β_s)         # twin-rail velocity, fp32
    d    ← lerp(g, w·fast + (1 − w)·slow, μ)                               # Nesterov lookahead
    X    ← d / (margin·‖d‖_F + eps), ‖d‖_F² read off the first Gram's trace  # bf16 (``whiten``)
    X    ← a·X + X·(b·A + c·A²), A = XᵀX (tall; wide: A = XXᵀ, left), six maps
    V    ← NorMuon's lane equaliser (optim/normuon.normuon_normalize_), ‖V‖_F kept
    W    ← W − W·[slow·W ≥ 0]·(wd·lr)·lr_eff − V·lr_eff                    # decay gated on the slow rail
    bf16 W is stepped in fp32 through its uint16 mantissa (optim/normuon.join_fp32)

μ is the scheduled momentum (the recipe's warm-up 0.85 → 0.93 over 240 steps, back over the last 50). Before
the engage step the update reads the fast rail alone (w = 1) on β_f = μ; from it on, β_f = 0.85 and
w = 0.4385. The slow rail (β_s = 0.98) accumulates from step 0 either way.

Value embeddings (the ``value_embed`` group, which the bigram table joins): Adam every other step like the
other Adam labels, then from ``every4_from`` (#92: 336) on steps ≡ 3 (mod 4), on the gradients of the
four steps summed; one update then stands for two, so both betas are squared and the decay doubled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from speedrun.optim.cautious_adam import AdamLabel
from speedrun.optim.normuon import normuon_normalize_, second_moment_shape
from speedrun.optim.sharded import Collectives, ShardedNorMuonAdam
from speedrun.optim.table import Bank, Row

#: The six quintic maps (a, b, c) of X ← aX + X(bA + cA²), re-derived for #92 (its README: tail gain
#: 643.13, envelope [0.9951, 1.00041]); not Polar Express's.
ANVIL_MAPS = (
    (3.923798038567, -6.095026865488, 3.905234618423),
    (3.278126713798, -3.328923386476, 0.989127286973),
    (3.505298394150, -5.137358782410, 1.968325560615),
    (2.815058591845, -3.685181239622, 1.417196497642),
    (2.245503932403, -2.443826979899, 0.963091710461),
    (2.256537145403, -2.166840097229, 0.929501253245),
)
#: Matrices with more rows than this add a·X after the product (two ops) rather than in it (#92's
#: mlp bank, 2,816 rows; its Q/K and V/O banks take one op): a different bf16 rounding, kept as the record's
SPLIT_ROWS = 1024


@dataclass(frozen=True)
class Rails:
    """The twin-rail velocity and the cascade's normalisation (#92's constants as defaults)."""

    slow_beta: float = 0.98
    fast_beta: float = 0.85  # the fast rail's beta from the engage step on (before it: the momentum)
    fast_weight: float = 0.4385  # the fast rail's share of the blend from the engage step on
    engage_step: int = 514
    margin: float = 1.05  # X / (margin·‖X‖_F + eps): every singular value safely below 1
    eps: float = 1e-6


def twin_rail_nesterov_(
    grad: Tensor, fast: Tensor, slow: Tensor, fast_beta: float, slow_beta: float, weight: float, mu: float
) -> Tensor:
    """Both rails updated in place (EMAs of the gradient) and the Nesterov direction
    lerp(g, w·fast + (1 − w)·slow, μ) returned; ``grad`` is overwritten with it."""
    fast.lerp_(grad, 1 - fast_beta)
    slow.lerp_(grad, 1 - slow_beta)
    blend = weight * fast + (1 - weight) * slow
    return grad.lerp_(blend, mu)


def whiten(
    d: Tensor,
    dtype: torch.dtype = torch.bfloat16,
    margin: float = 1.05,
    eps: float = 1e-6,
    maps: tuple[tuple[float, float, float], ...] = ANVIL_MAPS,
) -> Tensor:
    """ANVIL's cascade on a (..., rows, cols) stack in ``dtype`` (bf16 as the record): every singular
    value is driven towards 1. The first Gram is taken before the normalisation, its trace (‖d‖_F²) gives
    the scale, and X and the Gram are rescaled instead of recomputed. Tall matrices work on the small
    XᵀX from the right, wide and square ones on XXᵀ from the left."""
    x = d.to(dtype).contiguous()
    tall = x.size(-2) > x.size(-1)
    split = x.size(-2) > SPLIT_ROWS
    batched = x.ndim > 2
    mm = torch.bmm if batched else torch.mm
    add_mm = torch.baddbmm if batched else torch.addmm

    def gram(x: Tensor) -> Tensor:
        return mm(x.mT, x) if tall else mm(x, x.mT)

    wide = torch.promote_types(dtype, torch.float32)  # the scale in fp32 (fp64 for an fp64 cascade)
    a_mat = gram(x)
    trace = a_mat.diagonal(dim1=-2, dim2=-1).to(wide).sum(-1)[..., None, None]
    scale = trace.sqrt() * margin + eps
    x = (x.to(wide) / scale).to(dtype)
    a_mat = (a_mat.to(wide) / scale.square()).to(dtype)
    for k, (a, b, c) in enumerate(maps):
        if k > 0:
            a_mat = gram(x)
        b_mat = add_mm(a_mat, a_mat, a_mat, beta=b, alpha=c)  # b·A + c·A²
        pair = (x, b_mat) if tall else (b_mat, x)
        x = mm(*pair).add_(x, alpha=a) if split else add_mm(x, *pair, beta=a)  # a·X + X·B (B·X)
    return x


def every4_hyper(hp: AdamLabel) -> AdamLabel:
    """An Adam label's hyperparameters when one update stands for two steps: betas squared, decay doubled."""
    return replace(hp, betas=(hp.betas[0] ** 2, hp.betas[1] ** 2), weight_decay=2 * hp.weight_decay)


class ShardedAnvilAdam(ShardedNorMuonAdam):
    """ANVIL on the matrices + labelled Adam, sharded as ShardedNorMuonAdam (see the module docstring).
    The matrix group's ``momentum`` (set by the schedule) is μ; the optimizer counts its own steps for the
    engage step and the cadence. ``beta2`` is the lane equaliser's EMA (#92: 0.9)."""

    state_format = "sharded-anvil-adam-1"
    readable_formats = (state_format,)

    def __init__(
        self,
        rows: list[Row],
        adam: dict[str, AdamLabel],
        muon_lr: float,
        momentum: float,
        beta2: float,
        muon_weight_decay: float,
        rails: Rails = Rails(),
        ns_dtype: torch.dtype = torch.bfloat16,
        adam_every: int = 1,
        every4_from: int = 0,
        every4_labels: tuple[str, ...] = ("value_embed",),
        square_stats: str = "rows",
        frozen_labels: tuple[str, ...] = (),
        tie: tuple[Tensor, Tensor, int] | None = None,
        comms: Collectives | None = None,
    ) -> None:
        assert not every4_from or (adam_every == 2 and every4_from % 4 == 0), "config checks: 2 then 4"
        self.rails = rails
        self.every4_from, self.every4_labels = every4_from, every4_labels
        super().__init__(
            rows, adam, muon_lr=muon_lr, momentum=momentum, beta2=beta2, muon_weight_decay=muon_weight_decay,
            ns_dtype=ns_dtype, adam_every=adam_every, square_stats=square_stats, frozen_labels=frozen_labels,
            tie=tie, comms=comms,
        )  # fmt: skip

    def _init_state(self) -> None:
        super()._init_state()  # Adam's moments; the banks' state is ANVIL's own
        for bank in self.banks:
            shape = (bank.per_rank, *bank.shape)
            device = bank.members[0][0].param.device
            lanes = second_moment_shape(shape, bank.stats_rule(self.square_stats))
            st = {
                "fast_rail": torch.zeros(shape, device=device),
                "slow_rail": torch.zeros(shape, device=device),
                "lane_energy": torch.zeros(lanes, device=device),
            }
            if bank.dtype == torch.bfloat16:
                st["mantissa"] = torch.zeros(shape, dtype=torch.uint16, device=device)
            self.state[self._bank_key(bank)] = st

    def engaged(self) -> bool:
        """Whether this step blends the two rails (from the engage step on)."""
        return self.steps_done >= self.rails.engage_step

    def _bank_direction(
        self, bank: Bank, st: dict[str, Tensor], grads: Tensor, group: dict[str, Any]
    ) -> tuple[Tensor, Tensor | None]:
        k, r, mu = grads.shape[0], self.rails, group["momentum"]
        fast_beta, weight = (r.fast_beta, r.fast_weight) if self.engaged() else (mu, 1.0)
        slow = st["slow_rail"][:k]
        d = twin_rail_nesterov_(grads, st["fast_rail"][:k], slow, fast_beta, r.slow_beta, weight, mu)
        v = whiten(d, self.ns_dtype, r.margin, r.eps)
        v = normuon_normalize_(v, st["lane_energy"][:k], self.beta2, bank.stats_rule(self.square_stats))
        return v, slow

    def _every4(self, label: str) -> bool:
        return label in self.every4_labels and 0 < self.every4_from <= self.steps_done

    def _adam_due(self, label: str, do_adam: bool) -> bool:
        return self.steps_done % 4 == 3 if self._every4(label) else do_adam

    def _adam_hyper(self, label: str) -> AdamLabel:
        return every4_hyper(self.adam[label]) if self._every4(label) else self.adam[label]

    def describe(self) -> str:
        return super().describe().replace("NorMuon on", "ANVIL on", 1)


def bank_blend_rate(step: int, total: int, window: int, every: int) -> float | None:
    """ANVIL's bank tail-blend (#92, "a bank tail-blend ship step"): the rate at which its fp32 EMA of the
    banks follows the weights after step ``step`` (0-based) of ``total``, None where it does not tick. It
    ticks over the last ``window`` steps on steps ≡ 1 (mod ``every``) and on the last two (so the final
    iterate is always in), at 2/(window // every + 1): the window's EMA timescale counted in ticks."""
    if step < total - window or not (step % every == 1 or step >= total - 2):
        return None
    return 2.0 / (window // every + 1)


def bank_blends(blend: float, richardson: float) -> dict[str, float]:
    """How far each bank is shipped towards the blend's EMA: ``blend`` on qk; on vo and mlp, which the tail
    average shipped first, lowered by the Richardson correction of the EMA's lag behind the last iterate."""
    return {"qk": blend, "vo": blend - richardson, "mlp": blend - richardson}
