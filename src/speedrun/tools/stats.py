"""Statistics of the research commands: mean, sd and Welch's t-test (`ablate`, `verify --baseline`),
paired time ratios (`race`), seed noise and power (`noise`); the record rules' one-sample test is
`below_target_test` (compare, verify)."""

from __future__ import annotations

import importlib
import math
import warnings
from dataclasses import dataclass
from types import ModuleType

from speedrun.errors import SpeedrunError


def research_module(name: str, command: str) -> ModuleType:
    """Import a package of the `research` extra, or say in one line which command needs it and how to
    install it (they are not in the base install)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        package = name.split(".")[0]
        raise SpeedrunError(
            f"`speedrun {command}` needs {package}: pip install 'speedrun[research]'"
        ) from None


def below_target_test(losses: list[float], target: float) -> tuple[float, float]:
    """(t, p) of the one-sided one-sample t-test H1: mean < target (scipy.stats.ttest_1samp)."""
    stats = research_module("scipy.stats", "compare")
    with warnings.catch_warnings():  # equal losses: scipy warns of precision loss and returns nan
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_1samp(losses, target, alternative="less")
    return float(result.statistic), float(result.pvalue)


def mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation); None where there are too few values (0, or 1 for the sd)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1))


def welch_test(a: list[float], b: list[float], command: str) -> tuple[float, float] | None:
    """(t, two-sided p) of Welch's t-test of mean(a) vs mean(b) (scipy's ttest_ind, equal_var=False); None
    with fewer than 2 values on a side or when p is undefined (no spread)."""
    if len(a) < 2 or len(b) < 2:
        return None
    stats = research_module("scipy.stats", command)
    with warnings.catch_warnings():  # no spread on either side: scipy warns and returns nan
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_ind(a, b, equal_var=False)
    t, p = float(result.statistic), float(result.pvalue)
    return None if math.isnan(p) else (t, p)


# ---- paired timing (`race`) and noise (`noise`) ----


@dataclass
class Ratio:
    """Paired ratios B/A summarised on the log scale (times are multiplicative: a 2% gain is a ratio)."""

    n: int
    geomean: float
    low: float | None  # the 95% confidence interval of the geometric mean (t on the log ratios)
    high: float | None
    t_p: float | None  # two-sided paired t-test p on the log ratios (None below 2 pairs or with no spread)
    faster: int  # pairs where B took less time than A
    sign_n: int  # pairs that are not ties
    sign_p: float  # two-sided exact sign test p


def sign_test(wins: int, n: int) -> float:
    """Two-sided exact binomial (sign) test of `wins` out of `n` against 1/2: the probability of a split
    at least as uneven, summed in exact integers (scipy.stats.binomtest gives the same)."""
    if n == 0:
        return 1.0
    tail = min(wins, n - wins)
    count = sum(math.comb(n, i) for i in range(tail + 1))
    return min(1.0, 2 * count / 2**n)


def paired_ratio(a: list[float], b: list[float], command: str = "race") -> Ratio:
    """Geometric mean of b[i]/a[i], its 95% CI and paired t-test p from the t distribution of
    mean(log ratio) / (sd/√n), and the sign test of how many pairs B won."""
    assert len(a) == len(b) and a and all(x > 0 for x in [*a, *b])
    logs = [math.log(y / x) for x, y in zip(a, b, strict=True)]
    n, (mean, sd) = len(logs), mean_sd(logs)
    faster, ties = sum(v < 0 for v in logs), sum(v == 0 for v in logs)
    low = high = t_p = None
    if n >= 2 and sd:
        t_dist = research_module("scipy.stats", command).t
        se = sd / math.sqrt(n)
        half = float(t_dist.ppf(0.975, n - 1)) * se
        low, high = math.exp(mean - half), math.exp(mean + half)
        t_p = float(2 * t_dist.sf(abs(mean / se), n - 1))
    return Ratio(n, math.exp(mean), low, high, t_p, faster, n - ties, sign_test(faster, n - ties))


@dataclass
class Noise:
    """Seed noise against nondeterminism from K seeds x R repeats (one-way ANOVA with seeds as groups)."""

    seeds: int
    repeats: int
    within_sd: float  # pooled sd of repeats of one seed: the kernels' nondeterminism
    seed_means_sd: float | None  # sd of the K seed means (includes within_sd²/R)
    between_sd: float  # sd the seed itself adds: sqrt(max(0, MS_between - MS_within) / R)
    total_sd: float  # sd of one run at a fresh seed: sqrt(between² + within²)


def noise_components(groups: list[list[float]]) -> Noise:
    """Variance components of final losses grouped by seed, each group the repeats of one seed."""
    k, r = len(groups), len(groups[0])
    assert k >= 1 and r >= 2 and all(len(g) == r for g in groups)
    means = [sum(g) / r for g in groups]
    ms_within = sum((x - m) ** 2 for g, m in zip(groups, means, strict=True) for x in g) / (k * (r - 1))
    seed_sd = mean_sd(means)[1]
    between_var = max(0.0, seed_sd**2 - ms_within / r) if seed_sd is not None else 0.0
    return Noise(
        k, r, math.sqrt(ms_within), seed_sd, math.sqrt(between_var), math.sqrt(between_var + ms_within)
    )


def power(n: int, effect: float, sd: float, alpha: float, command: str = "noise") -> float:
    """Power of the two-sided two-sample t-test (n runs per arm, equal sd) to find a true difference
    `effect`: P(|T| > t_crit) with T noncentral t, df 2n-2, noncentrality effect / (sd·sqrt(2/n))."""
    stats = research_module("scipy.stats", command)
    df, nc = 2 * n - 2, abs(effect) / (sd * math.sqrt(2 / n))
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


def runs_needed(
    effect: float, sd: float, alpha: float = 0.01, goal: float = 0.8, most: int = 100_000
) -> int | None:
    """The fewest runs per arm whose t-test finds `effect` at p < alpha with probability >= goal (power
    grows with n: doubling, then bisection); None beyond `most` (no effect, or one far below the noise)."""
    if sd <= 0:
        return 2 if effect else None
    low, high = 1, 2  # power(low) < goal <= power(high) once found
    while power(high, effect, sd, alpha) < goal:
        low, high = high, high * 2
        if high > most:
            return None
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if power(mid, effect, sd, alpha) >= goal else (mid, high)
    return high


def power_one_sided(n: int, effect: float, sd: float, alpha: float, command: str = "certify") -> float:
    """Power of the one-sided one-sample t-test (n values, sd each) to find a true mean shift `effect`
    in its direction: P(T > t_crit) with T noncentral t, df n-1, noncentrality effect / (sd/sqrt(n)).
    The record rules' target test (below_target_test) and a paired test on log time ratios are this."""
    stats = research_module("scipy.stats", command)
    df, nc = n - 1, effect / (sd / math.sqrt(n))
    return float(stats.nct.sf(float(stats.t.ppf(1 - alpha, df)), df, nc))


def legs_needed(
    effect: float, sd: float, alpha: float = 0.01, goal: float = 0.8, most: int = 1000
) -> int | None:
    """The fewest values (>= 2) whose one-sided one-sample t-test finds `effect` > 0 at p < alpha with
    probability >= goal; None for no effect in the test's direction or beyond `most`."""
    if effect <= 0:
        return None
    if sd <= 0:
        return 2
    return next((n for n in range(2, most + 1) if power_one_sided(n, effect, sd, alpha) >= goal), None)
