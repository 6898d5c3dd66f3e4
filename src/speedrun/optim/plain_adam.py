"""Adam without bias correction (track 3 record #46's aux `Adam`, its CenterShrinkAdam at rho = 1): the
raw EMAs of the gradient and of its square, no (1 − βᵗ) factors, so the first steps move by
lr·g/(|g| + eps)·(1 − β1)/√(1 − β2) instead of lr. #46 trains the gains and biases with it
(`optim.scalar_bias_correction = false`), the embedding and head with torch's AdamW.

    m ← lerp(m, g, 1 − β1);  v ← lerp(v, g², 1 − β2);  p ← p − lr·m/(√v + eps)

The second moment is kept in fp32 (fp64 for fp64 weights: tests/fidelity/test_plain_adam.py compares with the
record's class in fp64).
"""

from __future__ import annotations

from typing import Any

import torch


class PlainAdam(torch.optim.Optimizer):
    """Bias-correction-free Adam; hyperparameters are read from each group every step."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps))

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                wide = torch.float64 if p.dtype == torch.float64 else torch.float32
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=wide)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.lerp_(p.grad.to(wide).square(), 1 - beta2)
                p.add_((m.to(wide) / (v.sqrt() + group["eps"])).to(p.dtype), alpha=-group["lr"])
