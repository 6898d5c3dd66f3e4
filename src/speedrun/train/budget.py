"""A run that fits a time budget: `train.time_budget_s` fixes the step count from measured step times.

Hosts differ about 20x in throughput (and bf16 ~100x), so a fixed step count cannot promise a CPU demo
its few minutes everywhere. With a budget, `train.steps` is the most the run may take; after
`PROBE_STEPS` timed steps the mean step time fixes the count once, `N = budget / step time`, and the
run's config.json is rewritten with that N (and the budget set to 0: it has been spent on choosing N),
so the LR schedule is a pure function of the step from then on and a resume continues exactly.

This is exact only if no value before the fix depends on the step count: the config check allows a
budget only with the trapezoid schedule, a warm-down given in steps and no window warm-up, and N never
falls below the step at the fix plus the warm-down, so every step before the fix lies on the constant
part of the schedule whatever N turns out to be.
"""

from __future__ import annotations

import math

PROBE_STEPS = 4  # timed steps measured before the step count is fixed


def fix_point(timing_warmup_steps: int) -> int:
    """The step (count of finished steps) at whose log point the step count is fixed."""
    return timing_warmup_steps + PROBE_STEPS


def budget_steps(
    budget_s: float, mean_step_s: float, untimed: int, done: int, warmdown_steps: int, max_steps: int
) -> int:
    """Steps whose timed part (all but the `untimed` warm-up steps) fits `budget_s` seconds at
    `mean_step_s` a step; at least the steps already `done` plus the warm-down (so the schedule so far
    stays valid) and at most `max_steps`."""
    assert mean_step_s > 0 and budget_s > 0, (mean_step_s, budget_s)
    fits = untimed + math.floor(budget_s / mean_step_s)
    return max(done + warmdown_steps + 1, min(max_steps, fits))
