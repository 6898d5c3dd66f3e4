"""Bad inputs beyond the first catalogue (docs/bad-inputs.md, second table): each ends in one stderr
line and exit 1 or 2, never a traceback, a silent run or a half-usable folder. In-process CLI calls."""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from speedrun.config import Config
from speedrun.config.data import parse_fineweb_source
from speedrun.errors import ConfigError
from tests.conftest import TINY, run_speedrun

FAST = [*TINY, "train.steps=3", "train.warmdown_steps=1", "train.val_every=0"]


def one_line(proc: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """The single stderr line of a failed command (rank-specific lines say `speedrun (rank N):`)."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speedrun") and "error:" in lines[0], proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------------------- launch env

LAUNCH_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"WORLD_SIZE": "abc", "RANK": "0"}, "WORLD_SIZE='abc' must be an integer >= 1"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE='0' must be an integer >= 1"),
        ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),  # trained silently as a non-zero rank
        (
            {"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"},
            "RANK=3 must be below",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is not set but WORLD_SIZE=2"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' must be an integer >= 0"),
    ],
)
def test_a_broken_launch_environment_is_one_line(env, fragment, text_data, tmp_path, monkeypatch):
    for key in LAUNCH_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    one_line(
        run_speedrun("train", "--out", str(out), f"data.dir={text_data}", *FAST), 2, fragment, "torchrun"
    )
    assert not out.exists()  # refused before the run directory is made


# ---------------------------------------------------------------------------------------- meta.json


def _train(data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_speedrun("train", "--out", str(out), f"data.dir={data}", *FAST, *extra)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"eot_id": -1}, "eot_id -1 is not a token id"),
        ({"eot_id": 512}, "eot_id 512 is not a token id"),
        ({"vocab_size": True}, "vocab_size must be int"),
        ({"train_shards": ["../../elsewhere_train_000000.bin"]}, "not a .bin file name in this folder"),
        ({"train_shards": []}, "bad entry for split 'train'"),
        ({"train_tokens": -5}, "bad entry for split 'train'"),
        ({"train_shards": "plus val"}, "listed under both train and val"),  # "held-out" loss on trained data
    ],
)
def test_meta_json_with_impossible_values(data_copy, tmp_path, change, fragment):
    meta = json.loads((data_copy / "meta.json").read_text())
    if change.get("train_shards") == "plus val":
        meta["splits"]["train"]["shards"] += meta["splits"]["val"]["shards"]
    elif "train_shards" in change:
        meta["splits"]["train"]["shards"] = change["train_shards"]
    elif "train_tokens" in change:
        meta["splits"]["train"]["tokens"] = change["train_tokens"]
    else:
        meta.update(change)
    (data_copy / "meta.json").write_text(json.dumps(meta))
    one_line(_train(data_copy, tmp_path / "run"), 1, "meta.json", fragment)


def test_training_reads_the_shards_meta_json_lists_not_strays(data_copy, tmp_path):
    """A *_train_*.bin that meta.json does not list (a user's copy, a leftover) is never read."""
    (data_copy / "zz_train_000009.bin").write_bytes(b"not a shard")
    proc = _train(data_copy, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------------ run directories


def test_a_run_that_failed_before_step_0_can_be_started_again(text_data, tmp_path):
    out = tmp_path / "run"
    one_line(_train(tmp_path / "typo", out), 1, "data folder not found")
    assert (out / "config.json").is_file() and (out / "metrics.jsonl").read_bytes() == b""
    proc = _train(text_data, out)  # the same command with the folder fixed
    assert proc.returncode == 0, proc.stderr
    assert (out / "summary.json").is_file()


def test_a_folder_that_only_looks_like_a_failed_start_is_not_reused(text_data, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text("")
    (out / "log.txt").write_text("my notes\n")  # not our log
    one_line(_train(text_data, out), 2, "already holds a run")
    assert (out / "log.txt").read_text() == "my notes\n"


def test_seeds_check_every_run_folder_before_the_first_run(text_data, tmp_path):
    (tmp_path / "run-seed2").mkdir()
    (tmp_path / "run-seed2" / "notes.txt").write_text("mine")
    proc = run_speedrun(
        "train", "--out", str(tmp_path / "run"), "--seeds", "1,2", f"data.dir={text_data}", *FAST
    )
    one_line(proc, 2, "run-seed2 is not empty")
    assert not (tmp_path / "run-seed1").exists()  # nothing trained before the refusal


def test_resume_names_a_damaged_config_json(tmp_path):
    config = Config().to_dict()
    config["model"]["n_layer"] = "abc"
    (tmp_path / "config.json").write_text(json.dumps(config))
    one_line(run_speedrun("train", "--resume", str(tmp_path)), 2, "config.json is unusable", "model.n_layer")


# ----------------------------------------------------------------------------------- names and sources


def test_an_empty_recipe_name_is_not_the_default():
    one_line(run_speedrun("train", "--dry-run", "--recipe", ""), 2, "unknown recipe ''")
    one_line(run_speedrun("recipes", ""), 2, "unknown recipe ''")


def test_fineweb_shard_count_is_bounded_by_the_dataset():
    """kjj0/fineweb10B-gpt2 has train shards 1..103 (modded-nanogpt's cached_fineweb10B.py default):
    asking for more failed only after downloading all 103."""
    assert parse_fineweb_source("fineweb10B:103") == 103
    with pytest.raises(ConfigError, match="at most 103"):
        parse_fineweb_source("fineweb10B:104")


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("optim.lr=1e300", "optim.lr must be at most 3.403e+38"),  # finite, but not in fp32
        ("model.window=100000000000000000000", "model.window must be at most 9,223,372,036,854,775,807"),
        ("train.steps=9223372036854775808", "train.steps must be at most"),
    ],
)
def test_numbers_beyond_what_torch_holds_are_config_errors(override, fragment):
    """Python takes these, torch did not: an overflow traceback inside the first step."""
    one_line(run_speedrun("train", "--dry-run", override), 2, fragment)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["model.window_warmup=floor", "model.window_unit=256"], "model.window_unit (256) must not exceed"),
        (["model.window_warmup=ceil", "model.window_unit=256"], "model.window_unit (256) must not exceed"),
        (["model.window_warmup=floor", "model.window_warmup_start=1000"], "window_warmup_start (1000)"),
    ],
)
def test_a_window_warmup_that_would_exceed_the_window(overrides, fragment):
    """The first window would be larger than model.window: a ValueError at step 0 before."""
    proc = run_speedrun("train", "--dry-run", "model.window=128", *overrides)
    one_line(proc, 2, fragment)


def test_a_recipe_file_saved_with_a_byte_order_mark(tmp_path):
    """Windows editors start UTF-8 files with a BOM, which tomllib calls an invalid statement."""
    recipe = tmp_path / "mine.toml"
    recipe.write_bytes(b"\xef\xbb\xbf" + b'base = "demo"\n[model]\nn_layer = 3\n')
    proc = run_speedrun("train", "--dry-run", "--recipe", str(recipe))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout[: proc.stdout.index("\n}\n") + 2])["model"]["n_layer"] == 3


@pytest.mark.parametrize("kind", ["a folder with its own meta.json", "notes beside prepared shards"])
def test_prepare_never_replaces_a_folder_holding_the_users_files(kind, text_data, tmp_path):
    """`prepare` replaces an earlier prepared folder wholesale; it deleted any folder that merely had a
    meta.json (a user's project) and anything the user had put beside the shards."""
    target = tmp_path / "target"
    if kind.startswith("a folder"):
        target.mkdir()
        (target / "meta.json").write_text('{"name": "my project"}')
    else:
        shutil.copytree(text_data, target)
    (target / "notes.txt").write_text("precious")
    before = sorted(p.name for p in target.iterdir())
    source = f"text:{text_data.parent / 'docs.jsonl'}"
    proc = run_speedrun("prepare", source, "--tokenizer", "bpe:300", "--data-dir", str(target))
    one_line(proc, 1, str(target), "notes.txt", "not replacing it")
    assert sorted(p.name for p in target.iterdir()) == before
    assert (target / "notes.txt").read_text() == "precious"


def test_a_stray_rank_variable_does_not_silence_errors(monkeypatch, tmp_path):
    """Only rank 0 of a multi-process launch speaks; RANK=1 alone (a scheduler's variable) silenced
    every error of every command (exit 1 and nothing said)."""
    for key in LAUNCH_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    one_line(run_speedrun("compare", str(tmp_path)), 1, "not a run directory")


def test_resume_refuses_shards_prepared_again_under_the_same_names(tmp_path):
    """A data folder prepared again (other text, or another BPE of the same size) keeps its shard
    names; the loader state of a checkpoint only named them, so a resume trained on other token ids."""
    from speedrun.data.loader import TokenLoader
    from speedrun.data.shards import write_shard
    from speedrun.errors import DataError

    shard = tmp_path / "text-docs_train_000000.bin"
    rng = np.random.default_rng(0)
    write_shard(shard, rng.integers(0, 512, 5000))
    loader = TokenLoader([shard], 1024, 512, 64)
    loader.next_batch()
    state = loader.state_dict()
    TokenLoader([shard], 1024, 512, 64).load_state_dict(state)  # the same data resumes
    write_shard(shard, rng.integers(0, 512, 5000))  # same name, same length, other tokens
    with pytest.raises(DataError, match="changed since the checkpoint was saved"):
        TokenLoader([shard], 1024, 512, 64).load_state_dict(state)


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("wiki-vitl", "unknown source 'wiki-vitl'"),
        ("text:", "needs a path"),
        ("fineweb10B:500", "at most 103"),
    ],
)
def test_a_malformed_data_source_is_a_config_error(source, fragment):
    """With no data.dir the source names the data folder: a typo was `data/wiki-vitl: data folder
    not found` after the run folder was made; now it is a config error like any other key."""
    one_line(run_speedrun("train", "--dry-run", f"data.source={source}"), 2, "data.source:", fragment)


@pytest.fixture
def resumable(text_data, tmp_path) -> Path:
    """A run stopped after step 3 of 6 with a checkpoint there (the step-6 checkpoint removed)."""
    out = tmp_path / "run"
    extra = ["train.steps=6", "train.checkpoint_every=3", "train.checkpoint_keep=0"]
    assert _train(text_data, out, *extra).returncode == 0
    shutil.rmtree(out / "checkpoints" / "step_000006")
    return out


@pytest.mark.parametrize("damage", ["emptied", "removed"])
def test_resume_refuses_a_metrics_history_that_lost_its_records(resumable, damage):
    """The resumed run appended steps 4..6 to an empty file: a history that starts mid-run."""
    metrics = resumable / "metrics.jsonl"
    metrics.write_text("") if damage == "emptied" else metrics.unlink()
    one_line(run_speedrun("train", "--resume", str(resumable)), 1, "no record of step 3")
    assert not metrics.exists() or metrics.read_text() == ""  # not written to


def test_resume_still_continues_an_intact_history(resumable):
    before = [json.loads(line) for line in (resumable / "metrics.jsonl").read_text().splitlines()]
    proc = run_speedrun("train", "--resume", str(resumable))
    assert proc.returncode == 0, proc.stderr
    after = [json.loads(line) for line in (resumable / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in after if "train_loss" in r][-1] == 6
    kept = [r for r in before if r["step"] < 3 or (r["step"] == 3 and "val_loss" not in r)]
    assert after[: len(kept)] == kept  # the history up to the checkpoint is kept as it was
