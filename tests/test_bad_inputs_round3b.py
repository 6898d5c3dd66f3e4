"""Third round of faults, second part (docs/bad-inputs.md, third table): compare's repeats, sample's
numbers, the compile flag in the log, overrides after options, permissions that are not damage."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import another_run, run_speedrun
from tests.test_bad_inputs_round3 import finished  # noqa: F401  (the module's shared tiny run)

# ------------------------------------------------------------------------------------------ compare


def _group_line(stdout: str) -> str:
    (line,) = [x for x in stdout.splitlines() if x.startswith("group ")]
    return line


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


# ------------------------------------------------------------------------------------------- sample


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


# --------------------------------------------------------------------------- overrides after options


def test_overrides_may_follow_options(tmp_path):
    from speedrun.cli import _build_parser, parse

    def parsed(*argv: str):
        return parse(_build_parser(), list(argv))

    out = str(tmp_path / "x")
    before = parsed("train", "model.n_layer=2", "train.steps=3", "--out", out)
    after = parsed("train", "--out", out, "model.n_layer=2", "train.steps=3")
    between = parsed("train", "model.n_layer=2", "--out", out, "train.steps=3")
    assert after.overrides == before.overrides == between.overrides == ["model.n_layer=2", "train.steps=3"]
    assert after.out == before.out == between.out
    seeds = parsed("train", "--seeds", "1,2", "model.n_layer=2")
    assert seeds.seeds == "1,2" and seeds.overrides == ["model.n_layer=2"]
    runs = parsed("compare", "a", "--target", "3", "b")
    assert runs.runs == [Path("a"), Path("b")] and runs.target == 3


def test_a_dry_run_with_overrides_on_both_sides_of_an_option_is_the_same_run(tmp_path):
    out = str(tmp_path / "x")
    split = run_speedrun("train", "model.n_layer=3", "--out", out, "train.val_every=7", "--dry-run")
    together = run_speedrun("train", "model.n_layer=3", "train.val_every=7", "--out", out, "--dry-run")
    assert split.returncode == 0, split.stderr  # before: "unrecognized arguments: train.val_every=7"
    assert split.stdout == together.stdout and '"n_layer": 3' in split.stdout


def test_compare_runs_on_both_sides_of_an_option(finished, tmp_path):  # noqa: F811
    second = another_run(finished, tmp_path / "second")
    proc = run_speedrun("compare", str(finished), "--target", "99", str(second))
    assert proc.returncode == 0, proc.stderr
    assert "n=2" in _group_line(proc.stdout)


# --------------------------------------------------------------------------------------- permissions


def test_a_checkpoint_we_may_not_read_is_not_called_damaged(finished, monkeypatch):  # noqa: F811
    """(As root, chmod does not stop reads: the denial is injected where the files are read.)"""
    import pytest

    from speedrun.errors import SpeedrunError
    from speedrun.tools.runs import load_model
    from speedrun.train.run import checkpoint

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint, "_sha256", denied)
    with pytest.raises(SpeedrunError) as e:
        load_model(finished)
    assert str(e.value).startswith("permission denied: ") and "model.safetensors" in str(e.value)
    assert "damaged" not in str(e.value) and "mv " not in str(e.value)  # before: advised moving it away


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("args", [["recipes"], ["recipes", "demo"]])  # more than stdout's buffer, and less
def test_a_full_stdout_is_named_not_taken_for_a_full_disk(args):
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "speedrun", *args],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0] == "speedrun: error: cannot write standard output: No space left on device"
