"""Schedule functions that several record scripts share line for line, written once; each script's own
constants (its step counts) are the arguments."""

from __future__ import annotations


def muon_momentum(step: int, total: int) -> float:
    """get_muon_momentum of #42 to #89 and track 2's #18: 0.85 → 0.95 over 300 steps, back to 0.85 over
    the last 50 of the `total` steps (scheduled plus extension)."""
    cd_start = total - 50
    if step < 300:
        return 0.85 + step / 300 * (0.95 - 0.85)
    if step > cd_start:
        return 0.95 - (step - cd_start) / 50 * (0.95 - 0.85)
    return 0.95


def lr_half_cooldown(step: int, n: int) -> float:
    """get_lr of #38 and #42: constant, then a linear cool-down to 0.1 over the second half of `n` steps
    (x capped at 0.9999)."""
    x = min(0.9999, step / n)
    lr = 1.0
    if x >= 1 - 0.5:
        w = (1 - x) / 0.5
        lr = w * 1.0 + (1 - w) * 0.1
    return lr
