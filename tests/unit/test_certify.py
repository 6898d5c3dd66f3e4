"""`speedrun certify`'s parts without training: the step-cut exchange rate and iso-loss line against a
hand computation and numpy's least squares, the legs a pilot asks for against a simulation of t-tests,
the ABBA order (race's, with the cut arms), the compile cache's measured state and the mixing refusal,
the pre-registration's edit refusal, the verdict's statistics against scipy on a ledger, usage errors."""

import math

import numpy as np
import pytest

from speedrun.cli import main
from speedrun.errors import ConfigError, DataError
from speedrun.tools import compile_cache
from speedrun.tools.certify_ledger import Ledger, register, registered_rule, sha256_bytes
from speedrun.tools.certify_phases import schedule
from speedrun.tools.certify_stepcut import exchange_rate, iso_loss
from speedrun.tools.certify_verdict import numbers
from speedrun.tools.race import block_orders
from speedrun.tools.race import schedule as race_schedule
from speedrun.tools.stats import legs_needed, power_one_sided


def test_one_cut_exchange_rate_and_iso_loss_by_hand():
    # baseline 10.0 s at 4.000 nats; 12 fewer steps: 9.4 s at 4.012 -> 0.6 s = 600 ms for 12 millinats
    ex = exchange_rate((10.0, 4.000), {"C12": (9.4, 4.012)})
    assert ex.rate_ms_per_mnat == pytest.approx(600 / 12, rel=1e-9)
    assert dict(ex.per_cut)["C12"] == pytest.approx(50.0, rel=1e-9)
    # a candidate at 4.004 nats: the baseline's line reaches that loss at 10.0 s - 4 mnat x 50 ms = 9.8 s
    at, margin, beats = iso_loss(ex, (9.0, 4.004))
    assert (at, margin, beats) == (pytest.approx(9.8), pytest.approx(0.8), True)
    at, margin, beats = iso_loss(ex, (9.9, 4.004))  # 0.1 s slower than training 4/12 of the cut less
    assert (at, margin, beats) == (pytest.approx(9.8), pytest.approx(-0.1), False)
    assert exchange_rate((10.0, 4.0), {"C12": (9.0, 4.0)}) is None  # no loss given up: no price


def test_two_cut_exchange_rate_is_the_least_squares_line():
    points = {"A": (10.0, 4.000), "C12": (9.4, 4.012), "C24": (8.6, 4.030)}
    ex = exchange_rate(points["A"], {k: v for k, v in points.items() if k != "A"})
    # by hand: losses 4000, 4012, 4030 mnat (mean 4014), times 10000, 9400, 8600 ms (mean 28000/3):
    # Sxx = 14² + 2² + 16² = 456; Sxy = -14·(2000/3) - 2·(200/3) + 16·(-2200/3) = -21200
    assert ex.rate_ms_per_mnat == pytest.approx(21200 / 456, rel=1e-9)
    slope, intercept = np.polyfit(
        [v * 1000 for _, v in points.values()], [t * 1000 for t, _ in points.values()], 1
    )
    assert ex.time_at(4.020) == pytest.approx((intercept + slope * 4020) / 1000, rel=1e-9)
    assert dict(ex.per_cut) == pytest.approx({"C12": 600 / 12, "C24": 1400 / 30})


@pytest.mark.parametrize("effect,sd", [(0.5, 1.0), (0.01, 0.004), (0.03, 0.05)])
def test_legs_needed_is_the_fewest_with_power_as_simulated(effect, sd):
    from scipy import stats

    n = legs_needed(effect, sd, 0.01)
    assert (
        power_one_sided(n, effect, sd, 0.01)
        >= 0.8
        > (power_one_sided(n - 1, effect, sd, 0.01) if n > 2 else 0)
    )
    rng, trials = np.random.default_rng(n), 20_000
    x = rng.standard_normal((trials, n)) * sd - effect  # mean below 0 by `effect`: the target test's H1
    found = float(np.mean(stats.ttest_1samp(x, 0.0, axis=1, alternative="less").pvalue < 0.01))
    expected = power_one_sided(n, effect, sd, 0.01)
    assert abs(found - expected) < 4 * math.sqrt(expected * (1 - expected) / trials) + 2e-3
    assert legs_needed(-0.1, 1.0) is None and legs_needed(0.1, 0.0) == 2


def test_certify_order_is_races_abba_with_the_cut_arms_balanced():
    for pairs, seed in ((4, 0), (5, 3), (1, 2)):
        two = schedule("certify", pairs, ["A", "B"], seed, True, 0)
        assert [(x.arm, x.index) for x in two] == race_schedule(block_orders(pairs, seed))
        assert all(x.seed == x.index for x in two)
    legs = schedule("certify", 4, ["A", "B", "C12", "C24"], 7, False, 0)
    assert all(x.seed is None for x in legs) and len(legs) == 16
    for block in (legs[:8], legs[8:]):  # every arm's mean place inside a block is the same
        places = {a: [i for i, x in enumerate(block) if x.arm == a] for a in ("A", "B", "C12", "C24")}
        assert {sum(p) / len(p) for p in places.values()} == {3.5}, places


def test_cache_state_is_measured_and_mixing_refused(tmp_path):
    folder = tmp_path / "cache"
    cold = compile_cache.measure(folder)
    assert (cold.state, cold.files_before, cold.bytes_before) == ("cold", 0, 0)
    (folder / "fxgraph").mkdir(parents=True)
    (folder / "fxgraph" / "entry").write_bytes(b"x" * 123)
    warm = compile_cache.measure(folder)
    assert (warm.state, warm.files_before, warm.bytes_before) == ("warm", 1, 123)
    log = (
        "batch: 1 tokens/step ..., compile True, bf16 autocast\n"
        "warm-up: 1 training step(s) and one validation batch compiled in 12.5 s, state restored\n"
    )
    after = compile_cache.after_run(warm, log)
    assert (after.compiled, after.compile_s) == (True, 12.5)
    states = {"a": cold.as_dict(), "b": warm.as_dict(), "c": None}
    with pytest.raises(ConfigError) as e:
        compile_cache.refuse_mixed(states, "the race", allow=False)
    assert (
        "mixes cold and warm" in str(e.value)
        and "--allow-mixed-cache" in str(e.value)
        and "\n" not in str(e.value)
    )
    assert compile_cache.refuse_mixed(states, "the race", allow=True) == "mixed"
    assert compile_cache.refuse_mixed({"a": cold.as_dict(), "c": None}, "x", allow=False) == "cold"
    assert compile_cache.cache_folder({"TORCHINDUCTOR_CACHE_DIR": str(folder)}) == folder


def test_an_edited_preregistration_is_refused(tmp_path):
    ledger = Ledger(tmp_path)
    assert registered_rule(tmp_path, ledger) is None
    digest = register(tmp_path, ledger, {"N": 4, "alpha": 0.01})
    rule, again = registered_rule(tmp_path, ledger)
    assert rule["N"] == 4 and again == digest == sha256_bytes(
        (tmp_path / "PREREGISTRATION.json").read_bytes()
    )
    path = tmp_path / "PREREGISTRATION.json"
    path.write_text(path.read_text().replace('"N": 4', '"N": 3'))
    with pytest.raises(DataError) as e:
        registered_rule(tmp_path, ledger)
    assert "changed after it was registered" in str(e.value) and "\n" not in str(e.value)


def _leg(arm, pair, val, time_s, outcome="finished"):
    return {"kind": "leg", "leg": f"certify-{arm}-{pair:02d}", "arm": arm, "pair": pair, "outcome": outcome,
            "final_val_loss": val if outcome == "finished" else None, "train_time_s": time_s}  # fmt: skip


def test_the_verdicts_statistics_are_scipys_on_the_ledger():
    from scipy import stats

    a = [(4.10, 10.2), (4.12, 10.5), (4.09, 10.1), (4.11, 10.4)]
    b = [(4.05, 9.9), (4.07, 10.0), (4.06, 10.2), (4.02, 9.7)]
    legs = [_leg("A", i + 1, v, t) for i, (v, t) in enumerate(a)] + [
        _leg("B", i + 1, v, t) for i, (v, t) in enumerate(b)
    ]
    legs.append(
        _leg("B", 5, None, None, "crashed")
    )  # recorded, counted in the verdict's all-legs line, no number
    num = numbers(legs, 4.08)
    vb, va = [v for v, _ in b], [v for v, _ in a]
    assert num["rule2"]["p"] == pytest.approx(
        stats.ttest_1samp(vb, 4.08, alternative="less").pvalue, rel=1e-9
    )
    assert num["welch"]["p"] == pytest.approx(stats.ttest_ind(vb, va, equal_var=False).pvalue, rel=1e-9)
    logs = stats.ttest_rel([math.log(t) for _, t in b], [math.log(t) for _, t in a])
    assert num["ratio"]["t_p"] == pytest.approx(logs.pvalue, rel=1e-9) and num["ratio"]["n"] == 4
    assert num["n"] == {"A": 4, "B": 4}


def test_usage_errors(tmp_path, capsys):
    out = tmp_path / "c"
    base = ["certify", "--recipe", "demo", "--baseline", "demo", "--set", "train.time_budget_s=0",
            "--set", "train.budget_min_steps=0", "--set", "train.steps=8"]  # fmt: skip
    cases = [
        (["certify", "--recipe", "demo", "--out", str(out)], "--baseline"),
        ([*base, "--out", str(out), "--resume", str(out)], "not both"),
        ([*base, "--out", str(out), "--pilot", "1"], "--legs N"),
        ([*base, "--out", str(out), "--step-cut", "a,b"], "--step-cut"),
        ([*base, "--out", str(out), "--step-cut", "8"], "trains only 8 steps"),
        ([*base, "--out", str(out), "train.seed=3"], "train.seed"),
        ([*base, "--out", str(out), "--alpha", "0.7"], "--alpha"),
        (["certify", "--recipe", "demo", "--baseline", "demo", "--out", str(out)], "time budget"),
        (["certify", "--resume", str(tmp_path)], "no certify there"),
    ]
    for args, text in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("speedrun: error:") and text in err and "\n" not in err, (args, err)
    assert not out.exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert main([*base, "--out", str(tmp_path / "taken")]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_race_and_noise_record_each_runs_cache_beside_their_runs(tmp_path):
    out, cache = tmp_path / "race", tmp_path / "cache"
    compiled = "batch: x, compile True, y\nwarm-up: z compiled in 3.5 s, state restored\n"
    for name, log in (("A-pair1", compiled), ("B-pair1", "batch: x, compile False, y\n")):
        (out / name).mkdir(parents=True)
        (out / name / "log.txt").write_text(log)
        compile_cache.record(out / name, compile_cache.measure(cache))
        cache.mkdir(exist_ok=True)
        (cache / "graph").write_bytes(b"12345")
    states = compile_cache.recorded([out / "A-pair1", out / "B-pair1", out / "C-pair1"])
    want = {"folder": str(cache), "files_before": 0, "bytes_before": 0, "state": "cold", "compiled": True}
    assert states["A-pair1"] == want | {"compile_s": 3.5}
    assert states["B-pair1"]["state"] == "warm" and states["B-pair1"]["compiled"] is False
    assert states["C-pair1"] is None
    # B compiled nothing: its warm folder cannot change its time, so the race is not mixed
    assert compile_cache.refuse_mixed(states, "the race", allow=False) == "cold"
    assert (
        compile_cache.summary_line(states, "cold")
        == "compile cache: cold in every compiled run; compile 3.5-3.5 s"
    )
