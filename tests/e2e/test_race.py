"""`speedrun race`: the paired statistics against scipy on fixed numbers, the seeded block order written
before the first run, and a tiny CPU race end to end (resumed, a damaged arm folder, mixed hardware)."""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

import speedrun
from speedrun.cli import main
from speedrun.tools import race as race_tool
from speedrun.tools.race import block_orders, schedule
from speedrun.tools.stats import paired_ratio, sign_test
from tests.conftest import TINY

FAST = ["train.steps=6", "train.warmdown_steps=2", "train.val_every=3", "train.log_every=2",
        "train.checkpoint_every=3"]  # fmt: skip
SWITCH = "model.unet=true"
A = [61.2, 60.8, 62.0, 61.5, 60.9, 61.7]
B = [60.1, 60.9, 61.1, 60.2, 60.0, 61.3]


def test_paired_ratio_matches_scipy():
    from scipy import stats

    r = paired_ratio(A, B)
    log_a, log_b = [math.log(x) for x in A], [math.log(x) for x in B]
    ref = stats.ttest_rel(log_b, log_a)
    ci = ref.confidence_interval(0.95)
    assert r.geomean == pytest.approx(math.exp(sum(log_b) / 6 - sum(log_a) / 6), rel=1e-12)
    assert (r.low, r.high) == pytest.approx((math.exp(ci.low), math.exp(ci.high)), rel=1e-10)
    assert r.t_p == pytest.approx(ref.pvalue, rel=1e-9)
    assert (r.faster, r.sign_n) == (5, 6)
    assert r.sign_p == pytest.approx(stats.binomtest(5, 6, 0.5).pvalue, rel=1e-12)
    one = paired_ratio(A[:1], B[:1])  # one pair: a ratio, no interval
    assert one.geomean == pytest.approx(B[0] / A[0]) and one.low is None and one.t_p is None


@pytest.mark.parametrize("wins,n", [(0, 1), (3, 3), (2, 7), (9, 20), (10, 20), (0, 12), (31, 40)])
def test_sign_test_is_scipys_binomtest(wins, n):
    from scipy import stats

    assert sign_test(wins, n) == pytest.approx(stats.binomtest(wins, n, 0.5).pvalue, rel=1e-12)


def test_block_order_is_seeded_and_balanced():
    orders = block_orders(5, seed=3)
    assert orders == block_orders(5, seed=3) and len(orders) == 3 and len(orders[-1]) == 2
    assert all(o in ("ABBA", "BAAB") for o in orders[:2]) and orders[-1] in ("AB", "BA")
    assert {tuple(block_orders(8, s)) for s in range(20)} != {tuple(block_orders(8, 0))}  # the seed matters
    legs = schedule(["ABBA", "BAAB", "BA"])
    assert legs == [("A", 1), ("B", 1), ("B", 2), ("A", 2), ("B", 3), ("A", 3), ("A", 4), ("B", 4),
                    ("B", 5), ("A", 5)]  # fmt: skip


def argv(data: Path, out: Path, *extra: str) -> list[str]:
    sets = [w for o in [*TINY, *FAST, f"data.dir={data}"] for w in ("--set", o)]
    return ["race", "--recipe", "demo", "--out", str(out), *sets, *extra]


def test_the_plan_is_written_before_the_first_run(text_data, tmp_path, monkeypatch, capsys):
    seen = []

    def no_training(cmd):  # stands in for the first run's process: what did it find on disk?
        seen.append(json.loads((tmp_path / "r" / "race.json").read_text()))
        return 3

    monkeypatch.setattr(race_tool, "run_child", lambda cmd: (no_training(cmd), None))
    assert main(argv(text_data, tmp_path / "r", "--pairs", "3", "--seed", "7", SWITCH)) == 1
    assert seen[0]["blocks"] == block_orders(3, 7) and seen[0]["switches"] == [SWITCH]
    err = capsys.readouterr().err.strip()
    assert "exit code 3" in err and "\n" not in err


def test_usage_errors(text_data, tmp_path, capsys):
    out = tmp_path / "r"
    cases = [
        (argv(text_data, out), "nothing to race"),
        (argv(text_data, out, "train.seed=3"), "pair's number"),
        (argv(text_data, out, "--pairs", "0", SWITCH), "--pairs"),
        (argv(text_data, out, "model.unet=false"), "the same"),
        (argv(text_data, out, "--python-b", "/no/such/python"), "no such executable"),
        (argv(text_data, out, "--python-b", "false"), "cannot import speedrun"),
        (["race", "--recipe", "demo", "--out", str(out), SWITCH], "train.time_budget_s=0"),
    ]
    for args, text in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("speedrun: error:") and text in err and "\n" not in err, (args, err)
    assert not out.exists()


def summary(out: Path, leg: str) -> dict:
    return json.loads((out / leg / "summary.json").read_text())


@pytest.mark.slow
def test_a_tiny_race_end_to_end(text_data, tmp_path, capsys):
    from scipy import stats

    out = tmp_path / "r"
    args = argv(text_data, out, "--pairs", "2", SWITCH)
    assert main(args) == 0
    text = capsys.readouterr().out
    a = [summary(out, f"A-pair{p}") for p in (1, 2)]
    b = [summary(out, f"B-pair{p}") for p in (1, 2)]
    ratio = math.sqrt(
        b[0]["train_time_s"] / a[0]["train_time_s"] * b[1]["train_time_s"] / a[1]["train_time_s"]
    )
    assert f"train time B/A: geometric mean {ratio:.4f}" in text
    la, lb = [s["final_val_loss"] for s in a], [s["final_val_loss"] for s in b]
    assert f"Welch p={stats.ttest_ind(lb, la, equal_var=False).pvalue:.3g}" in text
    assert f"A {sum(la) / 2:.4f} ± {stats.tstd(la):.4f}" in text
    assert [
        json.loads((out / f"A-pair{p}" / "config.json").read_text())["train"]["seed"] for p in (1, 2)
    ] == [1, 2]

    # stopped after its step-3 checkpoint: resumed, the rest reused, the same losses
    (out / "B-pair2" / "summary.json").unlink()
    shutil.rmtree(out / "B-pair2" / "checkpoints" / "step_000006")
    assert main(args) == 0
    again = capsys.readouterr().out
    assert again.count("finished before, reused") == 3 and again.count("resumed") == 1
    assert summary(out, "B-pair2")["final_val_loss"] == lb[1]

    # another race in the same folder, a damaged arm folder, a run from other hardware: one line each
    assert main(argv(text_data, out, "--pairs", "2", "model.qk_norm=false")) == 2
    assert "holds another race" in capsys.readouterr().err
    shutil.copytree(out, tmp_path / "keep")
    shutil.rmtree(out / "A-pair1")
    (out / "A-pair1").mkdir()
    (out / "A-pair1" / "notes.txt").write_text("mine")
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert "A-pair1 holds neither" in err and "\n" not in err
    moved = tmp_path / "keep"
    other = summary(moved, "B-pair1") | {"device_name": "NVIDIA H100 80GB HBM3"}
    (moved / "B-pair1" / "summary.json").write_text(json.dumps(other))
    assert main(argv(text_data, moved, "--pairs", "2", SWITCH)) == 1
    err = capsys.readouterr().err.strip()
    assert "not alike (hardware: " in err and "H100" in err and "\n" not in err
    for leg in ("A-pair1", "A-pair2", "B-pair2"):  # all from another machine; one left to train here
        (moved / leg / "summary.json").write_text(json.dumps(other))
    (moved / "B-pair2" / "summary.json").unlink()
    shutil.rmtree(moved / "B-pair2" / "checkpoints" / "step_000006")
    assert main(argv(text_data, moved, "--pairs", "2", SWITCH)) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("speedrun: error: refused: the race's runs are not alike (hardware: 1 x cpu")
    assert "H100" in err and "\n" not in err and not (moved / "B-pair2" / "summary.json").exists()


@pytest.mark.slow
def test_python_b_races_the_same_recipe_under_another_python(text_data, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(argv(text_data, out, "--pairs", "1", "--python-b", sys.executable)) == 0
    text = capsys.readouterr().out
    ours = f"speedrun {speedrun.__version__} from {Path(speedrun.__file__).parent}"
    assert f"code: A {ours}; B {ours}" in text
    assert f"B = the recipe run by {sys.executable}" in text and ("1      AB" in text or "1      BA" in text)
    a, b = summary(out, "A-pair1"), summary(out, "B-pair1")
    assert a["final_val_loss"] == b["final_val_loss"]  # the same code and seed: the same run, timed twice
    assert f"geometric mean {b['train_time_s'] / a['train_time_s']:.4f}" in text
