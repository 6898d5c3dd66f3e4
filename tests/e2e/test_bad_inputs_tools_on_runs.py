"""Bad inputs and faults of compare, sample, eval, ablate and the reports, given run folders (docs/bad-
inputs.md): each ends in one stderr line and exit 1 or 2, or works; nothing we do not own is lost, nothing
is silently wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from speedrun.cli import main
from tests.bad_input_runs import (
    FAST,
    REPORTS,
    SHORT,
    _group_line,
    _specials,
    _untouched,
    error_line,
    one_line,
)
from tests.conftest import TINY, another_run, run_speedrun


def test_compare_plot_and_bench_json_onto_a_link_or_fifo(finished, tmp_path):
    specials = _specials(tmp_path)
    for path in (specials["link"], specials["fifo"]):
        one_line(run_speedrun("compare", str(finished), "--plot", str(path)), 1, f"{path}: is a")
        one_line(
            run_speedrun("bench", "--json", str(path), "--steps", "1", "--warmup", "0", *FAST), 1, "is a"
        )
    _untouched(tmp_path, specials)


def test_eval_limit_without_hellaswag_is_refused(finished):
    one_line(run_speedrun("eval", str(finished), "--limit", "5"), 2, "--limit", "needs --hellaswag")


def test_compare_counts_a_run_once_however_it_is_named(finished, tmp_path, monkeypatch):  # noqa: F811
    link = tmp_path / "link"
    link.symlink_to(finished)
    monkeypatch.chdir(finished.parent)
    proc = run_speedrun("compare", str(finished), str(link), f"../{finished.parent.name}/run", "run")
    assert proc.returncode == 0, proc.stderr
    line = _group_line(proc.stdout)
    assert "n=1" in line and "p=" not in line, line  # one run is no evidence (before: n=4, p=0)
    second = another_run(finished, tmp_path / "second")  # a second run still counts (a copy: round3c)
    assert "n=2" in _group_line(run_speedrun("compare", str(finished), str(second)).stdout)


def test_compare_leaves_stopped_and_killed_runs_out_of_the_test(finished, tmp_path):  # noqa: F811
    runs = [another_run(finished, tmp_path / f"r{i}") for i in range(4)]
    summary = json.loads((runs[2] / "summary.json").read_text())
    (runs[2] / "summary.json").write_text(json.dumps({**summary, "status": "stopped"}))
    (runs[3] / "summary.json").unlink()  # killed (or still running): no summary
    proc = run_speedrun("compare", *map(str, runs), "--target", "99")
    assert proc.returncode == 0, proc.stderr
    line = _group_line(proc.stdout)
    assert "n=2" in line and "2 unfinished run(s) left out" in line, line
    assert "r2 (stopped)" in proc.stdout and "r3 (unfinished)" in proc.stdout


def test_a_tiny_temperature_samples_like_greedy():
    import torch

    from speedrun.model.kv_cache import pick_next

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 10
    for temperature in (1e-300, 5e-324, 1e-40):
        for top_k in (None, 5):
            picked = pick_next(logits, 50, temperature, top_k, torch.Generator().manual_seed(1))
            assert torch.equal(picked, logits.argmax(dim=-1)), (temperature, top_k)


def test_sample_at_a_tiny_temperature_prints_the_greedy_text(finished):  # noqa: F811
    greedy = run_speedrun("sample", str(finished), "--max-tokens", "4", "--temperature", "0")
    tiny = run_speedrun("sample", str(finished), "--max-tokens", "4", "--temperature", "1e-300")
    assert tiny.returncode == 0 and tiny.stderr == "", tiny.stderr  # before: a traceback from multinomial
    assert greedy.returncode == 0 and tiny.stdout == greedy.stdout


def test_compare_runs_on_both_sides_of_an_option(finished, tmp_path):  # noqa: F811
    second = another_run(finished, tmp_path / "second")
    proc = run_speedrun("compare", str(finished), "--target", "99", str(second))
    assert proc.returncode == 0, proc.stderr
    assert "n=2" in _group_line(proc.stdout)


def test_compare_counts_a_copied_run_once_and_keeps_the_copy_furthest_along(uncheckpointed, tmp_path):
    """A run copied to another folder (another disk, a backup) is one run: counted once (before: n=2 and
    a t-test on one run's loss), and of the copies the furthest along is kept, with one line saying so."""
    run = uncheckpointed
    copy = Path(shutil.copytree(run, tmp_path / "copy"))
    (copy / "summary.json").unlink()  # copied while it trained
    proc = run_speedrun("compare", str(copy), str(run))
    assert proc.returncode == 0, proc.stderr
    run_id = json.loads((run / "config.json").read_text())["run_id"]
    note = f"{copy} and {run} are copies of one run (run id {run_id}): counted once, from the latter"
    assert proc.stdout.splitlines()[0] == note
    assert "n=1" in _group_line(proc.stdout) and "unfinished" not in proc.stdout  # the finished copy kept
    second = another_run(run, tmp_path / "second")  # a run of its own with the same losses still counts
    assert "n=2" in _group_line(run_speedrun("compare", str(run), str(second)).stdout)


def test_compare_of_runs_from_before_run_ids_keeps_the_real_path_rule(uncheckpointed, tmp_path):
    old = Path(shutil.copytree(uncheckpointed, tmp_path / "old"))
    config = json.loads((old / "config.json").read_text())
    del config["run_id"]
    (old / "config.json").write_text(json.dumps(config))
    (tmp_path / "link").symlink_to(old)
    proc = run_speedrun("compare", str(old), str(tmp_path / "link"))
    assert proc.returncode == 0 and "n=1" in _group_line(proc.stdout), proc.stderr


@pytest.mark.parametrize("command", REPORTS, ids=lambda c: f"{c[0]} {c[-1]}")
def test_a_report_never_replaces_a_runs_own_file(tmp_path, command):
    """`verify RUN --json RUN/summary.json` replaced the run's result with the report (and the next
    verify read the report as a finished run's summary); likewise --plot onto log.txt. Refused before any
    work, whether the file is there or not, through `..` or a link to the folder; a new name beside is
    fine."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    files = {"config.json": b'{"recipe": "demo"}', "metrics.jsonl": b'{"step": 0}\n', "log.txt": b"code: x\n"}
    for name, data in files.items():
        (run / name).write_bytes(data)
    (tmp_path / "link").symlink_to(run)
    targets = ["summary.json", "config.json", "metrics.jsonl", "log.txt", "checkpoints/step_000003/x"]
    for target in targets:
        for where in (run / target, tmp_path / "link" / target, run / ".." / "run" / target):
            r = run_speedrun(*[str(run) if c == "RUN" else c for c in command], str(where))
            assert r.returncode == 2 and r.stderr.count("\n") == 1, (where, r.stderr)
            assert f"is the run {run}'s own {target.split('/')[0]}" in r.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == files
    assert not (run / "summary.json").exists() and not any((run / "checkpoints" / "step_000003").iterdir())
    from speedrun.tools.results import check_report

    check_report(run / "verify.json", "--json")  # a report beside the run's files is the user's to write


def test_a_report_never_replaces_a_data_folders_file(text_data, tmp_path):
    """`verify RUN --json DATA/meta.json` replaced the data folder's description (a FineWeb download is
    hours); its tokenizer and shards are refused alike."""
    data = tmp_path / "data"
    shutil.copytree(text_data, data)
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    for name in before:
        r = run_speedrun("compare", "RUN", "--plot", str(data / name))
        assert r.returncode == 2 and f"is the data folder {data}'s {name}; choose another name" in r.stderr
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before
    from speedrun.tools.results import check_report

    (tmp_path / "meta.json").write_text('{"project": "mine"}')  # a user's meta.json: no data folder
    check_report(tmp_path / ".cache" / "report.json", "--json")


@pytest.mark.slow
def test_ablate_starts_over_a_killed_arm_and_never_reuses_another_configs_run(text_data, tmp_path, capsys):
    """A run of the ablation killed before its first checkpoint (no summary.json, no checkpoint) was
    "holds neither a finished run nor a checkpoint; remove it", though `train --resume` starts such a run
    over: ablate now does the same, and the result is the uninterrupted run's. A finished run copied
    under another arm's name was reused as that arm's result (the variant's row showed the baseline's
    loss); now refused, before anything trains, as is a killed run of another config."""
    from speedrun.tools.ablate import plan

    overrides = [*TINY, f"data.dir={text_data}", "train.steps=4", "train.warmdown_steps=1"]
    overrides.append("train.val_every=2")
    out = tmp_path / "abl"
    arms = plan("demo", [1], overrides, ["model.qk_norm=false"], out)
    folder, other = arms[0].runs[0][1], arms[1].runs[0][1]
    argv = ["ablate", "--recipe", "demo", "--seeds", "1", "--out", str(out)]
    argv += [w for o in overrides for w in ("--set", o)] + ["model.qk_norm=false"]
    assert main(argv) == 0
    straight = json.loads((folder / "summary.json").read_text())["final_val_loss"]
    metrics = (folder / "metrics.jsonl").read_text().splitlines(keepends=True)
    shutil.rmtree(other)
    shutil.copytree(folder, other)  # the baseline's finished run under the variant's name
    capsys.readouterr()
    assert main(argv) == 1
    assert f"{other} holds a run of another config" in capsys.readouterr().err
    for f in (folder, other):  # killed at step 2: no summary, no checkpoint, the records of steps 0-2
        (f / "summary.json").unlink()
        shutil.rmtree(f / "checkpoints", ignore_errors=True)
        (f / "metrics.jsonl").write_text("".join(metrics[:3]))
    assert main(argv) == 1
    assert f"{other} holds a run of another config" in capsys.readouterr().err
    assert not (folder / "summary.json").exists()  # refused before anything trained
    shutil.rmtree(other)
    assert main(argv) == 0
    assert "started over" in capsys.readouterr().out
    assert json.loads((folder / "summary.json").read_text())["final_val_loss"] == straight

    def losses(lines: list[str]) -> list[tuple]:
        return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in map(json.loads, lines)]

    again = (folder / "metrics.jsonl").read_text().splitlines()
    assert losses(again) == losses(metrics)  # each step once, as the uninterrupted run wrote them


def test_an_ablation_switch_that_changes_only_reporting_is_refused(text_data, tmp_path):
    """`ablate ... train.log_every=3` trained the baseline twice and reported the difference between
    them as the switch's effect (it changes no loss, token count or training time)."""
    sets = [x for o in [*TINY, *SHORT, f"data.dir={text_data}"] for x in ("--set", o)]
    for switch in ("train.log_every=3", "train.checkpoint_every=2", "train.sample_every=5"):
        got = run_speedrun(
            "ablate", "--recipe", "demo", "--out", str(tmp_path / "ab"), "--seeds", "1", *sets, switch
        )
        error_line(got, 2, f"switch {switch} changes only what the runs report", "would repeat the baseline")
    assert not (tmp_path / "ab").exists()  # refused before anything trained


def _as_older_run(run: Path, to: Path, seed: int, source: str | None = None) -> Path:
    """A copy of `run` as a run from before run ids and the data fingerprint (an own seed; another corpus's
    source in summary.json when `source` is given)."""
    shutil.copytree(run, to)
    config = json.loads((to / "config.json").read_text())
    config.pop("run_id")
    config["train"]["seed"] = seed
    (to / "config.json").write_text(json.dumps(config))
    log = (to / "log.txt").read_text().splitlines()
    (to / "log.txt").write_text("\n".join(ln for ln in log if not ln.startswith("data: ")) + "\n")
    if source is not None:
        summary = json.loads((to / "summary.json").read_text()) | {"data_source": source}
        (to / "summary.json").write_text(json.dumps(summary))
    return to


def test_an_older_run_on_another_corpus_is_not_taken_as_alike(finished, tmp_path):
    """issue 46: a run from before the data fingerprint was grouped with new runs whatever its corpus, and
    verify called them alike. Its meta.json source is compared now; an older run on the same source still
    groups (what it lacks sets no runs apart)."""
    other = _as_older_run(finished, tmp_path / "other", 5, source="text:elsewhere.jsonl")
    same = _as_older_run(finished, tmp_path / "same", 6)
    proc = run_speedrun("compare", str(finished), str(other), str(same), "--target", "9")
    groups = [ln for ln in proc.stdout.splitlines() if ln.startswith("group ")]
    assert proc.returncode == 0 and len(groups) == 2, proc.stdout + proc.stderr
    assert "n=2" in groups[0] and "n=1" in groups[1] and "elsewhere" in groups[1], groups
    proc = run_speedrun("verify", str(finished), str(other))
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("alike"))
    assert "fails" in line and "elsewhere" in line, line


def test_two_copies_of_an_older_run_count_once(finished, tmp_path):
    """issue 46: without a run id, two copies of one old run were two repeats (n=2, a t-test on one run)."""
    old = _as_older_run(finished, tmp_path / "old", 7)
    copy = Path(shutil.copytree(old, tmp_path / "copy"))
    proc = run_speedrun("compare", str(old), str(copy))
    assert proc.returncode == 0, proc.stderr
    assert "are copies of one run (no run id; the same config.json and first step time)" in proc.stdout
    assert "n=1" in _group_line(proc.stdout)
    second = _as_older_run(finished, tmp_path / "second", 7)  # another old run: its own first step time
    metrics = (second / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(ln) for ln in metrics]
    first = next(i for i, r in enumerate(records) if r.get("time_s", 0) > 0)
    records[first]["time_s"] += 0.001
    (second / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "n=2" in _group_line(run_speedrun("compare", str(old), str(second)).stdout)
