"""`speedrun noise`: the variance components against scipy's one-way ANOVA, the power calculation
against a simulation of t-tests in fp64, and a tiny CPU run of 2 seeds x 2 repeats end to end."""

import json
import math

import numpy as np
import pytest

from speedrun.cli import main
from speedrun.tools.stats import noise_components, power, runs_needed
from tests.conftest import TINY

FAST = ["train.steps=6", "train.warmdown_steps=2", "train.val_every=3"]
GROUPS = [
    [3.2811, 3.2790, 3.2802],
    [3.2755, 3.2771, 3.2760],
    [3.2840, 3.2829, 3.2851],
    [3.2790, 3.2799, 3.2781],
]


def test_noise_components_match_scipys_anova():
    from scipy import stats

    n = noise_components(GROUPS)
    k, r = len(GROUPS), len(GROUPS[0])
    ms_within = float(np.mean([np.var(g, ddof=1) for g in GROUPS]))
    f = stats.f_oneway(*GROUPS).statistic  # MS_between / MS_within, MS_between = r * var(seed means)
    assert n.within_sd == pytest.approx(math.sqrt(ms_within), rel=1e-10)
    assert n.between_sd == pytest.approx(math.sqrt(ms_within * (f - 1) / r), rel=1e-9)
    assert n.total_sd**2 == pytest.approx(n.between_sd**2 + n.within_sd**2, rel=1e-12)
    assert (n.seeds, n.repeats) == (k, r)
    same = noise_components([[1.0, 1.2], [1.1, 1.0]])  # seed means closer than repeats: no seed variance
    assert same.between_sd == 0 and same.total_sd == same.within_sd


@pytest.mark.parametrize("n,effect", [(4, 1.0), (9, 0.8), (20, 0.5)])
def test_power_matches_a_simulation_of_t_tests(n, effect):
    from scipy import stats

    rng = np.random.default_rng(n)
    trials = 40_000
    a = rng.standard_normal((trials, n))
    b = rng.standard_normal((trials, n)) + effect
    found = float(np.mean(stats.ttest_ind(a, b, axis=1).pvalue < 0.01))
    expected = power(n, effect, 1.0, 0.01)
    assert abs(found - expected) < 4 * math.sqrt(expected * (1 - expected) / trials) + 1e-3, (found, expected)


def test_runs_needed_is_the_fewest_with_enough_power():
    for effect, sd in ((0.005, 0.004), (0.01, 0.003), (0.002, 0.006)):
        n = runs_needed(effect, sd)
        assert power(n, effect, sd, 0.01) >= 0.8 > power(n - 1, effect, sd, 0.01), (effect, sd, n)
    assert runs_needed(0.0, 0.01) is None and runs_needed(0.01, 0.0) == 2


def argv(data, out, *extra):
    sets = [w for o in [*TINY, *FAST, f"data.dir={data}"] for w in ("--set", o)]
    return ["noise", "--recipe", "demo", "--out", str(out), *sets, *extra]


def test_usage_errors(text_data, tmp_path, capsys):
    out = tmp_path / "n"
    cases = [
        (argv(text_data, out, "--repeats", "1"), "--repeats"),
        (argv(text_data, out, "--effect", "-0.1"), "--effect"),
        (argv(text_data, out, "--set", "train.seed=3"), "from --seeds"),
        (["noise", "--recipe", "demo", "--out", str(out)], "train.time_budget_s=0"),
    ]
    for args, text in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("speedrun: error:") and text in err and "\n" not in err, (args, err)
    assert not out.exists()


@pytest.mark.slow
def test_two_seeds_twice_end_to_end(text_data, tmp_path, capsys):
    out = tmp_path / "n"
    assert main(argv(text_data, out, "--seeds", "2", "--effect", "0.02")) == 0
    text = capsys.readouterr().out
    groups = [
        [
            json.loads((f / "summary.json").read_text())["final_val_loss"]
            for f in sorted(out.glob(f"seed{s}-*"))
        ]
        for s in (1, 2)
    ]
    assert [len(g) for g in groups] == [2, 2]
    within = math.sqrt(np.mean([np.var(g, ddof=1) for g in groups]))
    total = math.sqrt(
        max(within**2, np.var([np.mean(g) for g in groups], ddof=1) - within**2 / 2 + within**2)
    )
    assert f"within-seed sd (nondeterminism, repeats of one seed): {within:.4f}" in text
    assert f"one run at a fresh seed: sd {total:.4f}" in text
    assert f"  0.0200 (--effect): {runs_needed(0.02, total)}" in text
    assert main(argv(text_data, out, "--seeds", "2", "--effect", "0.02")) == 0  # all reused
    assert capsys.readouterr().out.count("finished before, reused") == 4
