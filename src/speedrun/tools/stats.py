"""Two-sample statistics of `ablate` and `verify --baseline`: mean, sd and Welch's t-test.

The one-sample test of the record rules (mean below the target) is compare's `below_target_test`.
"""

from __future__ import annotations

import math
import warnings

from speedrun.tools.compare import research_module


def mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation); None where there are too few values (0, or 1 for the sd)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1))


def welch_test(a: list[float], b: list[float], command: str) -> tuple[float, float] | None:
    """(t, two-sided p) of Welch's two-sample t-test (unequal variances) of mean(a) vs mean(b), by
    scipy.stats.ttest_ind(equal_var=False); None with fewer than 2 values on a side or when p is
    undefined (both sides without spread)."""
    if len(a) < 2 or len(b) < 2:
        return None
    stats = research_module("scipy.stats", command)
    with warnings.catch_warnings():  # no spread on either side: scipy warns and returns nan
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_ind(a, b, equal_var=False)
    t, p = float(result.statistic), float(result.pvalue)
    return None if math.isnan(p) else (t, p)
