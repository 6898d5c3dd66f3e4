"""Learning-rate and momentum schedules, as pure functions of the step so resume is exact."""

from __future__ import annotations

import math

from speedrun.config import OptimConfig, TrainConfig


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Fraction of the peak LR at `step` (0-based optimizer step, valid for 0 <= step < cfg.steps).

    trapezoid: linear warmup over `warmup_steps` (step 0 gets 1/warmup), constant, then a linear
    warmdown over the last `warmdown_steps` that reaches `final_lr_frac` at the final step.
    cosine (llm.c): the same warmup, then cosine decay from 1 to `final_lr_frac` at the final step.
    """
    floor = cfg.final_lr_frac
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        span = max(1, cfg.steps - 1 - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    start = cfg.steps - cfg.warmdown_steps
    if cfg.warmdown_steps == 0 or step < start:
        return 1.0
    progress = (step - start + 1) / cfg.warmdown_steps  # 1/W on the first warmdown step, 1 on the last
    return 1.0 - (1.0 - floor) * progress


def muon_momentum(step: int, cfg: OptimConfig) -> float:
    """Muon momentum, warmed up linearly from `muon_momentum_start` to `muon_momentum`."""
    if cfg.muon_momentum_warmup_steps <= 0:
        return cfg.muon_momentum
    frac = min(1.0, step / cfg.muon_momentum_warmup_steps)
    return (1 - frac) * cfg.muon_momentum_start + frac * cfg.muon_momentum
