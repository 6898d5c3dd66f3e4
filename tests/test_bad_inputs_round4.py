"""The fourth adversarial round (issue 22): stage plans, verify, ablate. Each test failed before its fix."""

from __future__ import annotations

import json
import shutil

import pytest

from speedrun.config.stages import parse_stages
from speedrun.config.types import FP32_MAX, MAX_SEQ_LEN
from speedrun.errors import ConfigError
from tests.conftest import TINY, run_speedrun

MOMENTUM = {"momentum_min": 0.85, "momentum_max": 0.95, "momentum_warmup": 4, "momentum_cooldown": 3}
EXT = "tokens=128 windows=1/1 ext=2"


def plan(text: str, steps: int = 14):
    return parse_stages(text, steps, cooldown_frac=0.5, lr_floor=0.15, **MOMENTUM)


@pytest.mark.parametrize(
    ("stages", "words"),
    [
        # a fraction bypassed the finite, >= 0 check: nan and inf reached round() as a traceback
        (f"tokens=128 windows=1/1 frac=1e400/1e400; {EXT}", "frac must be a finite number >= 0"),
        (f"tokens=128 windows=1/1 frac=inf/1; {EXT}", "frac must be a finite number >= 0"),
        (f"tokens=128 windows=1/1 frac=-1/2; tokens=128 windows=1/1 frac=3/2; {EXT}", "finite number >= 0"),
        # a key given twice: the later one silently won
        (f"tokens=128 windows=1/1 frac=0.5 frac=1; {EXT}", "frac is given twice"),
        # windows beyond int32 positions: an OverflowError in the first step's mask
        (f"tokens=128 windows=1/{2**70} frac=1; {EXT}", "windows must be at most"),
        (f"tokens=128 windows=1/1 frac=1; {EXT} val={(MAX_SEQ_LEN - 1) // 128 + 1}", "val must be at most"),
        # an LR multiplier beyond fp32: a traceback in Adam's update
        (f"tokens=128 windows=1/1 frac=1 lr=1e39; {EXT}", "lr must be at most"),
        # fractions off 1 by more than rounding: accepted when they rounded to the step count
        (f"tokens=128 windows=1/1 frac=0.5; tokens=128 windows=1/1 frac=0.53; {EXT}", "add up to 1.03"),
        (f"tokens=128 windows=1/1 frac=0.5; tokens=128 windows=1/1 frac=0.47; {EXT}", "add up to 0.97"),
    ],
)
def test_a_stage_plan_that_cannot_run_as_written_is_one_config_error(stages, words):
    with pytest.raises(ConfigError, match="train.stages") as err:
        plan(stages)
    assert words in str(err.value)


def test_stage_plan_limits_are_what_torch_holds():
    """The largest window (int32 positions of blocks·128 + 1 tokens) and LR multiplier (fp32) still parse,
    and fractions that add up to 1 in floating point (0.6 + 0.3 + 0.1, thirds) are one."""
    blocks = (MAX_SEQ_LEN - 1) // 128
    p = plan(f"tokens=128 windows=1/{blocks} frac=1 lr={FP32_MAX!r}; {EXT} val={blocks}")
    assert p.stages[0].windows == (1, blocks) and blocks * 128 + 1 <= MAX_SEQ_LEN
    assert p.stages[0].lr_mul == FP32_MAX and p.val_long_window == blocks
    tenths = "; ".join(f"tokens=128 windows=1/1 frac={f}" for f in (0.6, 0.3, 0.1))
    assert [s.duration for s in plan(f"{tenths}; {EXT}", 22).stages[:3]] == [0.6, 0.3, 0.1]
    thirds = "; ".join(["tokens=128 windows=1/1 frac=1/3"] * 3)
    assert plan(f"{thirds}; {EXT}").scheduled_steps == 12


REPORTS = [("verify", "RUN", "--json"), ("compare", "RUN", "--plot"), ("bench", "--recipe", "demo", "--json")]


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
    from speedrun.cli import main
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


def test_an_extension_stage_without_steps_is_described_as_such():
    """ext=0: the extension stage trains no step (its windows serve the final validation); the log said
    `steps 14-13`."""
    from speedrun.train.stages import describe_stages, stage_bounds

    p = plan(f"tokens=128 windows=1/1 frac=1; {EXT.replace('ext=2', 'ext=0')}")
    assert stage_bounds(p)[-1] == (14, 14)
    line = describe_stages(p, 1, 1)
    assert "steps 0-13: 128 tokens" in line and "; no steps (ext=0: final validation only): 128" in line


def test_a_blank_stage_plan_in_a_recipe_file_is_no_plan(tmp_path):
    """`stages = "  "` in a recipe file (an override strips it; a file does not) is unset, as stage_plan
    reads it; the config check took it for a plan and failed its assert (a traceback)."""
    from speedrun.config.stages import stage_plan
    from speedrun.recipes import load_recipe

    recipe = tmp_path / "blank.toml"
    recipe.write_text('base = "demo"\n[train]\nstages = " \\n\\t "\n')
    cfg = load_recipe(str(recipe), TINY)
    assert cfg.train.stages.strip() == "" and stage_plan(cfg) is None
    assert stage_plan(load_recipe("demo", TINY)) is None  # what an unset plan gives
