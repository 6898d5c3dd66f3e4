"""`speedrun certify` end to end on tiny CPU legs: a harmful switch (learning rates near 0) is found and
its verdict's p-values are scipy's recomputed from the ledger; a pre-registration edited, or a resume
with another recipe, code or cache, is refused in one line; two identical arms find no difference while
certify is killed (-9) at random points of the smoke, pilot and certify phases and resumed, and every
completed leg is counted once."""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from speedrun.cli import main
from speedrun.tools import certify as certify_tool
from speedrun.tools.certify_ledger import sha256_bytes
from tests.conftest import TINY

FAST = ["train.steps=8", "train.warmdown_steps=2", "train.val_every=0", "train.timing_warmup_steps=0"]
HARMFUL = ["optim.muon_lr=0.0001", "optim.embed_lr=0.0001", "optim.head_lr=0.0001"]


def argv(data: Path, *extra: str) -> list[str]:
    sets = [w for o in [*TINY, *FAST, f"data.dir={data}"] for w in ("--set", o)]
    fixed = ["--smoke-steps", "2", "--target", "5.5"]
    return ["certify", "--recipe", "demo", "--baseline", "demo", *sets, *fixed, *extra]


def ledger(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_harmful_switch_is_found_and_the_p_values_are_scipys(text_data, tmp_path, capsys, monkeypatch):
    from scipy import stats

    out = tmp_path / "c"
    assert main(argv(text_data, "--out", str(out), "--pilot", "0", "--legs", "2", *HARMFUL)) == 1
    text = capsys.readouterr().out
    lines = ledger(out)
    legs = [e for e in lines if e["kind"] == "leg"]
    assert [e["leg"] for e in legs if e["phase"] == "smoke"] == ["smoke-A-01", "smoke-B-01"]
    assert sorted(e["leg"] for e in legs if e["phase"] == "certify") == [
        "certify-A-01", "certify-A-02", "certify-B-01", "certify-B-02"]  # fmt: skip
    digest = sha256_bytes((out / "PREREGISTRATION.json").read_bytes())
    assert [e["sha256"] for e in lines if e["kind"] == "preregistered"] == [digest]
    assert (
        lines.index(next(e for e in lines if e["kind"] == "preregistered")) == 2
    )  # before the first certify leg
    assert all(e["preregistration"] == digest for e in legs if e["phase"] == "certify")
    plan = sha256_bytes((out / "certify.json").read_bytes())
    assert all(e["plan"] == plan and e["code"] == certify_tool.code_hash() for e in legs)
    for e in legs:  # what each line says is what its run folder says
        summary = json.loads((out / e["folder"] / "summary.json").read_text())
        assert (e["final_val_loss"], e["train_time_s"], e["steps"]) == (
            summary["final_val_loss"], summary["train_time_s"], summary["steps"])  # fmt: skip
        assert e["cache"]["state"] == "cold" and e["cache"]["compiled"] is False and not e["crash"]
        assert e["device"] == "1 x cpu (AMD EPYC)" or e["device"].startswith("1 x cpu")

    cert = [e for e in legs if e["phase"] == "certify"]
    a = {e["pair"]: e for e in cert if e["arm"] == "A"}
    b = {e["pair"]: e for e in cert if e["arm"] == "B"}
    vb, va = [b[p]["final_val_loss"] for p in (1, 2)], [a[p]["final_val_loss"] for p in (1, 2)]
    verdict = json.loads((out / "verdict.json").read_text())
    num = verdict["numbers"]
    assert num["rule2"]["p"] == pytest.approx(stats.ttest_1samp(vb, 5.5, alternative="less").pvalue, rel=1e-9)
    assert num["welch"]["p"] == pytest.approx(stats.ttest_ind(vb, va, equal_var=False).pvalue, rel=1e-9)
    rel = stats.ttest_rel(
        [math.log(b[p]["train_time_s"]) for p in (1, 2)], [math.log(a[p]["train_time_s"]) for p in (1, 2)]
    )
    assert num["ratio"]["t_p"] == pytest.approx(rel.pvalue, rel=1e-9)
    found = {x["rule"]: x for x in verdict["lines"]}
    assert min(vb) > max(va) + 0.5  # the learning rates near 0 cost the candidate most of its training
    assert (
        found["rule 2"]["status"] == "FAIL"
        and "a difference at p < 0.01" in found["val vs baseline"]["detail"]
    )
    assert f"Welch p={num['welch']['p']:.3g}: a difference" in text and not verdict["accepted"]
    assert sorted(p.name for p in (out / "record" / "logs").iterdir()) == sorted(
        f"{e['leg']}.1.txt" for e in legs)  # fmt: skip
    assert "| certify-B-01.1 | B |" in (out / "record" / "README.md").read_text()

    # the same folder again: a finished certify reprints its verdict and trains nothing more
    assert main(["certify", "--resume", str(out)]) == 1
    assert "===" not in capsys.readouterr().out and len(ledger(out)) == len(lines)
    # another recipe, cache state or code: refused in one line, before anything runs
    for extra, text_in in (
        (["--recipe", "demo-adamw"], "started with recipe"),
        (["--cache", "warm"], "started with cache"),
        (["--legs", "3"], "started with legs"),
    ):
        assert main(["certify", "--resume", str(out), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert text_in in err and "\n" not in err, err
    monkeypatch.setattr(certify_tool, "code_hash", lambda: "0" * 64)
    assert main(["certify", "--resume", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "started with the code" in err and "\n" not in err
    monkeypatch.undo()
    prereg = out / "PREREGISTRATION.json"
    prereg.write_text(prereg.read_text().replace('"alpha": 0.01', '"alpha": 0.05'))
    assert main(["certify", "--resume", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "changed after it was registered" in err and "\n" not in err
    assert len(ledger(out)) == len(lines)


def _trainers_in(out: Path) -> list[int]:
    """Processes whose command line names `out` (a leg still training after certify died)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if str(out).encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def _kill_during(args: list[str], marker: str, rng: random.Random, out: Path) -> str:
    """Start certify, wait for a line starting with `marker`, wait a random time, kill -9 it."""
    child = subprocess.Popen([sys.executable, "-u", "-m", "speedrun", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    seen = []
    for line in child.stdout:
        seen.append(line)
        if line.startswith(marker):
            time.sleep(rng.uniform(0.0, 8.0))
            child.send_signal(signal.SIGKILL)
            break
    child.wait()
    assert child.returncode == -signal.SIGKILL, "".join(seen)
    time.sleep(0.5)
    assert not _trainers_in(out), "a leg kept training after certify was killed"
    return "".join(seen)


@pytest.mark.slow
def test_killed_in_every_phase_identical_arms_resume_counts_each_leg_once(text_data, tmp_path, capsys):
    seed = int(time.time())
    rng = random.Random(seed)
    out = tmp_path / "c"
    _kill_during(argv(text_data, "--out", str(out), "--pilot", "1", "--legs", "2"), "=== smoke", rng, out)
    _kill_during(["certify", "--resume", str(out)], "=== pilot", rng, out)
    _kill_during(["certify", "--resume", str(out)], "=== certify certify-", rng, out)
    assert main(["certify", "--resume", str(out)]) == 1
    text = capsys.readouterr().out
    legs = [e for e in ledger(out) if e["kind"] == "leg"]
    counted = [e["leg"] for e in legs if e["outcome"] != "interrupted"]
    planned = ["smoke-A-01", "smoke-B-01", "pilot-A-01", "pilot-B-01"]
    planned += [f"certify-{a}-{p:02d}" for a in "AB" for p in (1, 2)]
    assert sorted(counted) == sorted(planned), (seed, counted)  # each completed leg once, none lost
    for e in legs:  # an interrupted attempt was run again under a new attempt number
        if e["outcome"] == "interrupted":
            assert any(x["leg"] == e["leg"] and x["attempt"] == e["attempt"] + 1 for x in legs), (seed, e)
    assert not any(e["crash"] for e in legs)
    cert = {
        (e["arm"], e["pair"]): e["final_val_loss"]
        for e in legs
        if e["phase"] == "certify" and e["outcome"] == "finished"
    }
    assert cert[("A", 1)] == cert[("B", 1)] and cert[("A", 2)] == cert[("B", 2)]  # the same leg twice
    verdict = json.loads((out / "verdict.json").read_text())
    found = {x["rule"]: x for x in verdict["lines"]}
    assert "no difference at p < 0.01" in found["val vs baseline"]["detail"], seed
    assert found["rule 4"]["status"] == "NO" and found["all legs"]["status"] == "PASS", seed
    assert "not accepted" in text
