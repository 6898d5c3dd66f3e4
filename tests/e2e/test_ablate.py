"""`speedrun ablate` end to end on a tiny recipe (2 arms x 2 seeds): the table against scipy computed
here from the runs' own files, reuse of finished runs, resume of a stopped one, and usage errors that
end before anything trains."""

import json
import shutil
from pathlib import Path

import pytest

from speedrun.cli import main
from speedrun.errors import ConfigError
from speedrun.tools.ablate import parse_seed_count
from speedrun.tools.flops import format_flops
from tests.conftest import TINY

FAST = ["train.steps=6", "train.warmdown_steps=2", "train.val_every=3", "train.checkpoint_every=3"]
SWITCH = "model.unet=true"


def sets(text_data: Path) -> list[str]:
    return [w for o in [*TINY, *FAST, f"data.dir={text_data}"] for w in ("--set", o)]


def table(out: str) -> dict[str, list[str]]:
    """The rows of the printed table by arm."""
    lines = out[out.index("\narm ") + 1 :].strip().splitlines()
    return {line.split()[0]: line.split()[1:] for line in lines[1:]}


def final_losses(folder: Path, arm: str) -> list[float]:
    runs = sorted(folder.glob(f"{arm}-seed*"))
    return [json.loads((r / "summary.json").read_text())["final_val_loss"] for r in runs]


@pytest.mark.slow
def test_ablate_table_matches_scipy_and_a_second_call_reuses_and_resumes(text_data, tmp_path, capsys):
    from scipy import stats

    out = tmp_path / "abl"
    argv = ["ablate", "--recipe", "demo", "--seeds", "2", "--out", str(out), *sets(text_data), SWITCH]
    assert main(argv) == 0
    first = capsys.readouterr().out
    rows = table(first)
    base, var = final_losses(out, "baseline"), final_losses(out, SWITCH)
    runs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert len(base) == len(var) == 2 and len(runs) == 4
    assert all(json.loads((out / r / "compile-cache.json").read_text())["state"] for r in runs)  # each run's
    assert sorted(p.name for p in out.iterdir()) == runs  # the study's folder holds its run folders only
    mean = sum(var) / 2
    assert rows[SWITCH][:3] == ["2", f"{mean:.4f}", f"{stats.tstd(var):.4f}"]
    assert rows[SWITCH][3] == f"{mean - sum(base) / 2:+.4f}"
    assert rows[SWITCH][4] == f"{stats.ttest_ind(var, base, equal_var=False).pvalue:.3g}"
    assert rows[SWITCH][5] == f"{6 * 1024:,}" and rows["baseline"][3:5] == ["-", "-"]
    summary = json.loads((sorted(out.glob(f"{SWITCH}-seed1-*"))[0] / "summary.json").read_text())
    assert rows[SWITCH][6] == format_flops(summary["train_flops"])  # the FLOPs axis

    # an interrupted ablation: one run stopped after its step-3 checkpoint, one finished
    stopped = sorted(out.glob(f"{SWITCH}-seed2-*"))[0]
    (stopped / "summary.json").unlink()
    shutil.rmtree(stopped / "checkpoints" / "step_000006")
    assert main(argv) == 0
    again = capsys.readouterr().out
    assert again.count("finished before, reused") == 3 and again.count("resumed from its checkpoint") == 1
    assert final_losses(out, SWITCH) == var  # the resumed run computes what it computed before
    assert {k: v[:-1] for k, v in table(again).items()} == {
        k: v[:-1] for k, v in rows.items()
    }  # not the time


def test_usage_errors_end_before_anything_trains(tmp_path, capsys):
    out = tmp_path / "abl"
    common = ["ablate", "--recipe", "demo", "--out", str(out)]
    cases = [
        ([*common, "model.not_a_key=1"], "unknown config key 'model.not_a_key'"),
        ([*common, "model.unet=false"], "the recipe's own value"),
        ([*common, "train.seed=4"], "from --seeds"),
        ([*common, "--seeds", "x", SWITCH], "--seeds 'x'"),
        ([*common, "--set", "model.unet=false", SWITCH], "also set for all arms"),
        ([*common, SWITCH, SWITCH], "given twice"),
        (common, "required: SWITCH=VALUE"),
    ]
    for argv, text in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("speedrun: error:") and text in err and "\n" not in err, (argv, err)
    assert not out.exists()


def test_a_folder_it_cannot_reuse_or_resume_is_named_not_overwritten(text_data, tmp_path, capsys):
    from speedrun.tools.ablate import plan

    out = tmp_path / "abl"
    overrides = [*TINY, *FAST, f"data.dir={text_data}"]
    folder = plan("demo", [1], overrides, [SWITCH], out)[0].runs[0][1]
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("not ours")
    argv = ["ablate", "--recipe", "demo", "--seeds", "1", "--out", str(out), *sets(text_data), SWITCH]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert f"{folder} holds neither a finished run nor a checkpoint" in err
    assert [p.name for p in out.iterdir()] == [folder.name] and (
        folder / "notes.txt"
    ).read_text() == "not ours"


def test_seed_counts_and_lists():
    assert parse_seed_count("3") == [1, 2, 3]
    assert parse_seed_count("5,2") == [5, 2]
    for bad in ("0", "x", "1,1", ""):
        with pytest.raises(ConfigError):
            parse_seed_count(bad)


def test_a_switch_of_several_keys_is_one_variant(tmp_path, capsys):
    """`KEY=V+KEY=V` is one arm whose config is the recipe with both overrides (load_recipe's own), for a
    technique that is off only when two keys say so; a `+` inside a value does not split it."""
    from speedrun.recipes import load_recipe
    from speedrun.tools.ablate import plan, split_switch

    both = "model.unet=true+model.x0_shortcut=true"
    arms = plan("demo", [1], [], [both], tmp_path / "abl")
    assert [a.label for a in arms] == ["baseline", both]
    want = load_recipe("demo", ["model.unet=true", "model.x0_shortcut=true", "train.seed=1"])
    assert arms[1].runs[0][0].to_dict() == want.to_dict()
    assert arms[1].runs[0][0].to_dict() != load_recipe("demo", ["model.unet=true", "train.seed=1"]).to_dict()
    assert split_switch("optim.lr=1e+3") == ["optim.lr=1e+3"]
    assert split_switch("a.b=1+ c.d =2") == ["a.b=1", "c.d =2"]
    common = ["ablate", "--recipe", "demo", "--out", str(tmp_path / "abl")]
    for argv, text in (
        ([*common, "model.unet=true+train.seed=2"], "from --seeds"),
        ([*common, "model.unet=true+model.unet=false"], "given twice"),
        ([*common, "--set", "model.x0_shortcut=true", both], "also set for all arms"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert text in err and "\n" not in err, (argv, err)


@pytest.mark.parametrize(
    "switch, says",
    [
        # issue 46: the arm was labelled as both changes while n_layer=4 is demo's own value
        ("model.n_layer=4+model.unet=true", "model.n_layer=4 is the recipe's own value (model.n_layer=4)"),
        ("model.unet=true+data.source=wiki-vital", "data.source=wiki-vital is the recipe's own value"),
        # issue 46: these ended in the first key's type check (`expected an integer, got '2+n_head=1'`)
        ("model.n_layer=2+n_head=1", "the value of model.n_layer runs into 'n_head'"),
        ("model.n_layer=2+model.n_head", "the value of model.n_layer runs into 'model.n_head'"),
        ("model.n_layer=2,model.n_head=2", "the value of model.n_layer runs into 'model.n_head'"),
    ],
)
def test_a_switch_part_that_changes_nothing_or_is_joined_wrongly_is_refused(switch, says, tmp_path, capsys):
    """The recipe's own values come from load_recipe (the reference): a part equal to them is refused."""
    from speedrun.recipes import load_recipe

    demo = load_recipe("demo")
    assert (demo.model.n_layer, demo.model.unet, demo.data.source) == (4, False, "wiki-vital")
    from speedrun.tools.ablate import plan  # (plan, not main: the old code trained these arms)

    with pytest.raises(ConfigError) as refused:
        plan("demo", [1], [], [switch], tmp_path / "abl")
    assert says in str(refused.value) and "expected an integer" not in str(refused.value)
    assert not (tmp_path / "abl").exists()


@pytest.mark.parametrize("what", ["ablation", "noise study"])
def test_a_stopped_study_names_the_same_command_not_one_runs_resume(what, text_data, tmp_path, monkeypatch):
    """issue 46: the stop line of ablate/noise named `speedrun train --resume RUN`, which goes on with one
    run and leaves the table unmade; the remedy is the same command (it reuses and resumes)."""
    import signal

    import speedrun.train.loop as loop
    from speedrun.tools.ablate import plan, train_arms
    from speedrun.train.signals import RunInterrupted

    def stopped(cfg, folder, **kw):
        raise RunInterrupted.after(signal.SIGTERM, 2, folder / "checkpoints" / "step_000002", folder)

    monkeypatch.setattr(loop, "train", stopped)
    arms = plan("demo", [1], [*TINY, f"data.dir={text_data}"], [SWITCH], tmp_path / "abl")
    with pytest.raises(RunInterrupted) as e:
        train_arms(arms, what)
    assert e.value.exit_code == 128 + signal.SIGTERM
    assert str(e.value).startswith("stopped by SIGTERM after step 2; saved checkpoint ")
    assert f"run the same {what} command again" in str(e.value) and "--resume" not in str(e.value)
