"""`speedrun verify` on run folders made by tiny real training runs, and on copies edited to break one
rule each: every rule's failure, the statistics against scipy and the formulas written here, older
folders that lack a fact (`unknown`, never a crash), and bad input as one line."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from speedrun.cli import main
from speedrun.tools.results import load_runs
from speedrun.tools.verify import verify
from speedrun.train.run.environment import DIFF_END, DIFF_START, code_version
from speedrun.train.run.tracking import hardware_name
from tests.conftest import read_metrics
from tests.e2e import runner

pytestmark = runner.uses("verify-seeds")  # one worker trains the runs once


@pytest.fixture
def runs(trained) -> list[Path]:
    """Three tiny demo runs that differ only in train.seed (runs.py `verify-seeds`, about 1 s in all)."""
    return trained("verify-seeds").folders


def copies(runs: list[Path], dst: Path, edit=None, which: int | None = None) -> list[Path]:
    """Copies of the runs; `edit(folder)` changes the copy number `which` (every copy when None)."""
    out = []
    for i, run in enumerate(runs):
        out.append(dst / run.name)
        shutil.copytree(run, out[-1], ignore=shutil.ignore_patterns("events.out.*"))
        if edit is not None and which in (None, i):
            edit(out[-1])
    return out


def edit_json(name: str, change):
    def edit(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        change(data)
        (folder / name).write_text(json.dumps(data))

    return edit


def edit_log(old: str, new: str):
    """Replace the first match of the regular expression `old` in log.txt."""

    def edit(folder: Path) -> None:
        text = (folder / "log.txt").read_text()
        assert re.search(old, text, flags=re.M), old
        (folder / "log.txt").write_text(re.sub(old, new, text, count=1, flags=re.M))

    return edit


def edit_starts(**values):
    """Set `values` in every start that summary.json records."""
    return edit_json("summary.json", lambda s: [start.update(values) for start in s["starts"]])


INDUCTOR_LINE = r"^inductor env: .*\n"  # `none`, or a TORCHINDUCTOR_CACHE_DIR set around the tests


def rules(paths: list[Path], target: float = 9.0, track: int = 1, baseline=None) -> dict[str, tuple]:
    verdicts = verify(load_runs(paths), track, target, load_runs(baseline) if baseline else None)
    return {v.rule: (v.status, v.detail) for v in verdicts}


def finals(paths: list[Path]) -> list[float]:
    return [[r for r in read_metrics(p) if "val_loss" in r][-1]["val_loss"] for p in paths]


def record_label(folder: Path) -> None:
    """The config's labels say the record validation (the data folder's meta.json does not)."""
    edit_json("config.json", lambda c: (c["train"].update(val_tokens=10_485_760), c["data"].update(
        source="fineweb10B", tokenizer="gpt2")))(folder)  # fmt: skip


def record_validation(folder: Path) -> None:
    record_label(folder)
    edit_json("summary.json", lambda s: s.update(data_source="fineweb10B:1"))(folder)


@pytest.mark.slow
def test_tiny_runs_fail_only_the_record_validation(runs, tmp_path, capsys):
    from scipy import stats

    report = tmp_path / "v.json"
    assert main(["verify", *map(str, runs), "--target", "9", "--json", str(report)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    got = {r["rule"]: (r["status"], r["detail"]) for r in json.loads(report.read_text())["rules"]}
    assert list(got) == [
        "finished",
        "target",
        "config",
        "code",
        "validation",
        "final-val",
        "softmax",
        "timing",
        "inductor",
        "warm-up",
        "hardware",
        "alike",
    ]
    assert len(lines) == len(got) + 3 and lines[-1].startswith("not accepted: 1 rule(s) fail")
    # the cost line, from the runs' files: training FLOPs (summary.json)
    flops = [json.loads((r / "summary.json").read_text())["train_flops"] for r in runs]
    reached = [next(m["tokens"] for m in read_metrics(r) if m.get("val_loss", 99) <= 9.0) for r in runs]
    assert lines[-2] == (
        f"cost: training FLOPs {sum(flops) / 3:.2e} per run; tokens to 9: ".replace("e+", "e")
        + f"{sum(reached) / 3:,.0f} (3 of 3 finished runs reached it)"
    )
    assert json.loads(report.read_text())["cost"]["reached_target"] == 3
    assert {r for r, (status, _) in got.items() if status != "ok"} == {"validation"}
    assert "train.val_tokens=2048" in got["validation"][1]
    p = stats.ttest_1samp(finals(runs), 9.0, alternative="less").pvalue
    assert f"p={p:.3g}" in got["target"][1]
    assert got["code"][1].startswith(code_version().splitlines()[0])  # the log's code line
    assert got["hardware"][1] == f"1 x {hardware_name('cpu')} in all runs"  # summary.json's new fields
    assert "seeds 1, 2, 3" in got["config"][1]


@pytest.mark.slow
def test_every_rule_passes_when_the_config_states_the_record_validation(runs, tmp_path, capsys):
    # the files are the whole input: a config with the rules' validation set passes every rule
    paths = copies(runs, tmp_path, record_validation)
    assert main(["verify", *map(str, paths), "--target", "9"]) == 0
    assert capsys.readouterr().out.strip().endswith("accepted: every rule passes")


BROKEN = {  # rule: (edit of the second run, words its failure names)
    "finished": (edit_json("summary.json", lambda s: s.update(status="stopped")), "r-seed2 (stopped)"),
    "config": (
        edit_json("config.json", lambda c: c["optim"].update(muon_lr=0.1)),
        "r-seed2 differs from r-seed1: optim.muon_lr=0.1 where r-seed1 has 0.05",
    ),
    "code": (edit_log("^code: .*$", "code: speedrun 0.0.1 git 0000000 (clean)"), "r-seed2: speedrun 0.0.1"),
    "alike": (edit_log("torch threads \\d+$", "torch threads 77"), "threads: "),
    "timing": (
        edit_starts(timing_warmup_steps=2),
        "steps 1-2 untimed (train.timing_warmup_steps=2 at its start)",
    ),
    "inductor": (
        edit_log(INDUCTOR_LINE, "inductor env: TORCHINDUCTOR_MAX_AUTOTUNE=1\n"),
        "MAX_AUTOTUNE=1",
    ),
    "hardware": (edit_starts(device_name="NVIDIA H100"), "1 x NVIDIA H100"),
}


@pytest.mark.slow
@pytest.mark.parametrize("rule", BROKEN)
def test_each_rule_fails_on_a_folder_edited_to_break_it(runs, tmp_path, rule):
    edit, words = BROKEN[rule]
    got = rules(copies(runs, tmp_path, edit, which=1))
    assert got[rule][0] == "fails" and words in got[rule][1], got[rule]
    assert all(status == "ok" for r, (status, _) in got.items() if r not in (rule, "validation")), got


@pytest.mark.slow
def test_other_failures_killed_runs_seeds_warm_up_and_cache_settings(runs, tmp_path):
    killed = copies(runs, tmp_path / "k", lambda f: (f / "summary.json").unlink(), which=0)
    assert "r-seed1 (no summary.json" in rules(killed)["finished"][1]
    same_seed = copies(runs, tmp_path / "s", edit_json("config.json", lambda c: c["train"].update(seed=2)), 0)
    assert "both ran train.seed=2" in rules(same_seed)["config"][1]
    assert (
        "its own seed" in rules(same_seed)["config"][1] and "speedrun noise" in rules(same_seed)["config"][1]
    )
    kept = copies(runs, tmp_path / "w", edit_log("^step ", "warm-up: 1 training step(s) compiled\nstep "), 0)
    assert rules(kept)["timing"][0] == "fails"
    cache = copies(
        runs, tmp_path / "c", edit_log(INDUCTOR_LINE, "inductor env: TORCHINDUCTOR_CACHE_DIR=/x\n"), 0
    )
    assert rules(cache)["inductor"][0] == "ok"  # where compiled code is cached changes no code


@pytest.mark.slow
def test_a_dirty_tree_passes_only_with_the_same_diff(runs, tmp_path):
    first = "speedrun 0.1.0 git 51cf411923068b6ecc3494607575879c84311be5 (dirty)"

    def dirty(diff: str):
        def edit(folder: Path) -> None:
            text = (folder / "log.txt").read_text()
            start = text.index("code: ") + len("code: ")
            end = text.index("\npython: ")
            (folder / "log.txt").write_text(
                f"{text[:start]}{first}\n{DIFF_START}\n{diff}\n{DIFF_END}{text[end:]}"
            )

        return edit

    same = copies(runs, tmp_path / "same", dirty("+a = 1"))
    status, detail = rules(same)["code"]
    assert status == "ok" and "(dirty), diff sha256" in detail
    other = copies(same, tmp_path / "other", dirty("+a = 2"), which=2)
    assert rules(other)["code"][0] == "fails"

    def resume_with_other_code(folder: Path) -> None:
        log = folder / "log.txt"
        log.write_text(log.read_text() + f"code: {first.replace('(dirty)', '(clean)')}\n")

    resumed = copies(same, tmp_path / "resumed", resume_with_other_code, which=0)
    status, detail = rules(resumed)["code"]
    assert status == "fails" and "r-seed1 was resumed with other code" in detail


@pytest.mark.slow
def test_target_rules_of_both_tracks_against_the_formulas(runs, tmp_path):
    losses = finals(runs)
    n, mean = len(losses), sum(losses) / len(losses)
    assert rules(runs, target=mean)["target"][0] == "fails"  # not below at p < 0.01
    assert "needs >= 2" in rules(runs[:1])["target"][1]
    edge = mean + 0.004 / math.sqrt(n)  # (target - mean)·√n = 0.004 exactly: the track-3 threshold
    assert rules(runs, target=edge + 1e-6, track=3)["target"][0] == "ok"
    assert rules(runs, target=edge - 1e-6, track=3)["target"][0] == "fails"
    assert "timing" not in rules(runs, track=3)  # track 3 scores steps, not time


@pytest.mark.slow
def test_baseline_on_the_same_hardware_is_compared_by_welch_and_refused_elsewhere(runs, tmp_path):
    from scipy import stats

    times = (106.0, 101.5, 102.0)
    slower = [
        copies([run], tmp_path / f"b{t}", edit_json("summary.json", lambda s, t=t: s.update(train_time_s=t)))[
            0
        ]
        for run, t in zip(runs, times, strict=True)
    ]
    status, detail = rules(runs, baseline=slower)["baseline"]
    ours = [json.loads((r / "summary.json").read_text())["train_time_s"] for r in runs]
    p = stats.ttest_ind(ours, times, equal_var=False).pvalue
    assert status == "ok" and f"Welch p={p:.3g}" in detail
    assert rules(slower, baseline=runs)["baseline"][0] == "fails"  # slower than its baseline
    elsewhere = copies(runs, tmp_path / "e", edit_starts(device_name="NVIDIA A100"))
    status, detail = rules(runs, baseline=elsewhere)["baseline"]
    assert status == "fails" and detail.startswith("refused: the baseline ran on 1 x NVIDIA A100")


@pytest.mark.slow
def test_older_run_folders_say_unknown(runs, tmp_path, capsys):
    def old(folder: Path) -> None:
        edit_json("summary.json", lambda s: [s.pop(k) for k in ("device_name", "world_size", "starts")])(
            folder
        )
        edit_log(INDUCTOR_LINE, "")(folder)

    paths = copies(runs, tmp_path, old)
    (paths[0] / "log.txt").unlink()
    assert main(["verify", *map(str, paths), "--target", "9"]) == 1
    out = capsys.readouterr().out
    assert "code       unknown: r-seed1: no log.txt" in out
    assert (
        "inductor   unknown: r-seed1" in out and "hardware   unknown: runs r-seed1, r-seed2, r-seed3" in out
    )


@pytest.mark.slow
def test_bad_inputs_are_one_line(runs, tmp_path, capsys):
    cases = [
        ([str(tmp_path / "missing")], 1, "not a run directory"),
        ([str(tmp_path)], 1, "not a run directory"),
        ([], 2, "required: RUN_DIR"),
        ([str(runs[0]), "--track", "5"], 2, "invalid choice: 5"),
        ([str(runs[0]), "--target", "nan"], 2, "--target must be a finite"),
        ([str(runs[0]), "--baseline", str(runs[0])], 2, "is also one of the runs"),
    ]
    for argv, code, text in cases:
        assert main(["verify", *argv]) == code, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("speedrun: error:") and text in err and "\n" not in err, (argv, err)


@pytest.mark.slow
def test_validation_is_judged_by_the_data_folders_source_not_the_label(runs, tmp_path, text_data):
    """Beside data.dir, data.source is only a label: runs on other data (fineweb-edu, say) whose recipe
    still says fineweb10B passed the validation rule. summary.json records the folder's meta.json source."""
    source = json.loads((text_data / "meta.json").read_text())["source"]
    assert [json.loads((r / "summary.json").read_text())["data_source"] for r in runs] == [source] * 3
    got = rules(copies(runs, tmp_path / "label", record_label))["validation"]
    assert got[0] == "fails" and f"r-seed1: data source {source};" in got[1], got
    older = copies(
        runs,
        tmp_path / "old",
        lambda f: (record_label(f), edit_json("summary.json", lambda s: s.pop("data_source"))(f)),
    )
    got = rules(older)["validation"]
    assert got[0] == "unknown" and "does not record the data's source" in got[1], got
    assert rules(copies(runs, tmp_path / "rec", record_validation))["validation"][0] == "ok"


@pytest.mark.slow
def test_a_baseline_that_is_a_copy_of_a_run_to_verify_is_refused(runs, tmp_path, capsys):
    """A copy keeps its run id (compare counts copies once); as a baseline it was compared with itself."""
    copy = copies(runs[:1], tmp_path)[0]
    assert main(["verify", *map(str, runs[:2]), "--baseline", str(copy), str(runs[2])]) == 2
    err = capsys.readouterr().err.strip()
    said = f"--baseline {copy} is also one of the runs to verify (a copy of {runs[0]}: the same run id)"
    assert err == f"speedrun: error: {said}"


def train_and_resume(root: Path, text_data: Path, first: int, then: int) -> Path:
    """A 6-step run with train.timing_warmup_steps=`first`, rewound to its step-3 checkpoint and resumed
    with `then`: the resumed config.json says only `then`."""
    run = root / "run"
    started = runner.execute("verify-resumable", run, text_data, f"train.timing_warmup_steps={first}")
    assert started.code == 0
    shutil.rmtree(run / "checkpoints" / "step_000006")
    assert runner.resume(run, f"train.timing_warmup_steps={then}").code == 0
    return run


@pytest.mark.slow
def test_timing_is_judged_over_every_start_of_a_resumed_run(tmp_path, text_data):
    """A run started with a timing warm-up and resumed with none passed as fully timed: verify read the
    last start's config only. Every start is kept in summary.json through the checkpoints."""
    run = train_and_resume(tmp_path / "a", text_data, first=2, then=0)
    summary = json.loads((run / "summary.json").read_text())
    assert [(s["step"], s["timing_warmup_steps"]) for s in summary["starts"]] == [(0, 2), (3, 0)]
    assert summary["timed_steps"] == 4  # step 3 of the first start, 4-6 of the resume
    status, detail = rules([run])["timing"]
    assert (
        status == "fails" and "trained steps 1-2 untimed (train.timing_warmup_steps=2 at its start)" in detail
    )
    run = train_and_resume(tmp_path / "b", text_data, first=0, then=2)
    status, detail = rules([run])["timing"]
    assert (
        status == "fails"
        and "steps 4-5 untimed (train.timing_warmup_steps=2 at its resume at step 3)" in detail
    )
    copy = copies([run], tmp_path / "old", edit_json("summary.json", lambda s: s.pop("starts")))[0]
    got = rules([copy])
    assert got["timing"][0] == got["hardware"][0] == "unknown", got  # resumed, starts not recorded


@pytest.mark.slow
def test_impossible_starts_in_summary_json_are_one_line(runs, tmp_path, capsys):
    """The starts a run records begin at step 0 and increase (each resume is from a later checkpoint);
    an edited list (out of order, a negative warm-up) was judged as if true."""
    start = {"step": 0, "world_size": 1, "device_name": "cpu", "timing_warmup_steps": 0}
    for i, starts in enumerate(([{**start, "step": 3}, start], [{**start, "timing_warmup_steps": -3}], [])):
        (copy,) = copies(
            runs[:1], tmp_path / str(i), edit_json("summary.json", lambda s, v=starts: s.update(starts=v))
        )
        assert main(["verify", str(copy), "--target", "9"]) == 1
        err = capsys.readouterr().err.strip()
        assert (
            err.startswith("speedrun: error:") and "summary.json: starts must" in err and "\n" not in err
        ), err
