"""End to end through the console entry point: a tiny run writes the run directory; mistakes give one line."""

import json
import math

import pytest

from speedrun.cli import main
from tests.conftest import TINY, run_speedrun


@pytest.mark.slow
def test_tiny_run_writes_run_directory_and_learns(text_data, tmp_path):
    out = tmp_path / "run"
    # in a child process, as a user runs it: the one test of `python -m speedrun` end to end
    proc = run_speedrun(
        "train", "--out", str(out), f"data.dir={text_data}", *TINY, subprocess_=True
    )  # as a user runs it
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "metrics.jsonl", "log.txt"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["n_layer"] == 2 and config["train"]["steps"] == 30
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("step" in r for r in records)
    train_records = [r for r in records if "train_loss" in r]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train_records] == list(range(1, 31))
    assert [r["step"] for r in val] == [0, 10, 20, 30]
    assert val[0]["val_loss"] == pytest.approx(math.log(512), abs=0.05)  # zero-init head: uniform
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.8
    assert all(r["val_bpb"] > 0 for r in val)
    assert all(r["time_s"] >= 0 and r["tokens"] == r["step"] * 1024 for r in records)
    log = (out / "log.txt").read_text()
    for needle in ("code: speedrun", "python:", "torch:", "cpu:", "params:", "peak memory", "done: val loss"):
        assert needle in log
    assert "done: val loss" in proc.stdout


def test_dry_run_prints_param_count(capsys):
    assert main(["train", "--recipe", "gpt2-baseline", "--dry-run", "model.pad_vocab_to=1"]) == 0
    out = capsys.readouterr().out
    assert "params: 124439808" in out.splitlines()
    assert json.loads(out[: out.index("\nparams:")])["recipe"] == "gpt2-baseline"


def test_recipes_lists_every_bundled_recipe(capsys):
    from speedrun.recipes import recipe_names

    assert main(["recipes"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == recipe_names()


@pytest.mark.parametrize(
    "args, code, fragment",
    [
        (["train", "--recipe", "nope", "--dry-run"], 2, "unknown recipe 'nope'"),
        (["train", "--dry-run", "model.n_layerz=3"], 2, "unknown config key 'model.n_layerz'"),
        (["train", "--dry-run", "train.steps=many"], 2, "train.steps: expected an integer"),
        (["train", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["train", "data.dir=/nonexistent/shards", "data.source=text:/x"], 1, "/nonexistent/shards"),
        (["prepare", "text:/nonexistent/file.txt"], 1, "/nonexistent/file.txt"),
        (["prepare", "nosuchsource"], 2, "nosuchsource"),
    ],
)
def test_user_mistakes_give_one_line_and_exit_code(args, code, fragment, tmp_path):
    proc = run_speedrun(*args, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speedrun: error:"), proc.stderr
    assert fragment in lines[0]
    assert "Traceback" not in proc.stderr


def test_vocab_mismatch_between_data_and_model_is_refused(text_data, tmp_path):
    proc = run_speedrun(
        "train", "--out", str(tmp_path / "r"), f"data.dir={text_data}", *TINY, "model.vocab_size=600"
    )
    assert proc.returncode == 1
    assert "vocab size 512 but model.vocab_size is 600" in proc.stderr
    proc = run_speedrun(
        "train", "--out", str(tmp_path / "r2"), f"data.dir={text_data}", *TINY, "data.tokenizer=gpt2"
    )
    assert proc.returncode == 1 and "tokenized with bpe:512" in proc.stderr


def test_corrupt_shard_is_refused(text_data, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(text_data, bad)
    shard = sorted(bad.glob("*_train_*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated body
    proc = run_speedrun("train", "--out", str(tmp_path / "r"), f"data.dir={bad}", *TINY)
    assert proc.returncode == 1 and shard.name in proc.stderr and "Traceback" not in proc.stderr
