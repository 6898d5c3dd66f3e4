"""The fifth adversarial round (issue 27): misleading messages, and what trials over stage plans,
verify, ablate, resume and sample found. Each test failed before its fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from speedrun.data.shards import HEADER_BYTES
from tests.conftest import TINY, run_speedrun

SHORT = ["train.steps=2", "train.warmdown_steps=1", "train.val_every=0"]


def one_line(proc, code: int, *words: str) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == code, (proc.returncode, err)
    assert err.startswith("speedrun: error:") and "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


@pytest.mark.parametrize(
    ("argv", "flag", "code"),
    [
        (["train", "--out", "{long}", *TINY, *SHORT], "--out", 2),
        (["train", "--resume", "{long}"], "--resume", 2),
        (["prepare", "wiki-vital", "--tokenizer", "bpe:300", "--data-dir", "{long}"], "--data-dir", 2),
        (["verify", "{run}", "--json", "{long}"], "--json", 2),
        (["sample", "{long}"], "the name", 1),  # a path read, not made: the CLI's one OSError line
        (["eval", "{long}"], "the name", 1),
    ],
)
def test_an_over_long_name_is_named_not_a_file_inside_it(argv, flag, code, tmp_path):
    """An over-long `--out` reported `.../manifest.json: File name too long`: the first file looked for
    inside it. The name that is too long is named, with the file system's limit."""
    long = str(tmp_path / ("a" * 300))
    run = tmp_path / "run"
    run.mkdir()
    got = run_speedrun(*[a.format(long=long, run=run) for a in argv])
    err = one_line(got, code, flag, "is 300 bytes", "allows")
    assert "manifest.json" not in err and "config.json" not in err and "File name too long" not in err


def test_a_prepared_folders_temporary_name_is_counted(tmp_path):
    """prepare builds `.NAME.tmp-XXXXXXXX` beside the target: a 250-byte name fits the folder but not
    that, and failed as `File name too long` on a name the user never gave."""
    got = run_speedrun(
        "prepare", "wiki-vital", "--tokenizer", "bpe:300", "--data-dir", str(tmp_path / ("d" * 250))
    )
    one_line(got, 2, "--data-dir", "is 250 bytes", "allows 241")


@pytest.fixture
def no_document_starts(data_copy) -> Path:
    """The test data with every end-of-text token of the train shards replaced by another id."""
    eot = json.loads((data_copy / "meta.json").read_text())["eot_id"]
    for shard in data_copy.glob("*_train_*.bin"):
        raw = bytearray(shard.read_bytes())
        tokens = np.frombuffer(raw, dtype=np.uint16, offset=HEADER_BYTES).copy()
        tokens[tokens == eot] = 5
        shard.write_bytes(bytes(raw[:HEADER_BYTES]) + tokens.tobytes())
    return data_copy


@pytest.mark.parametrize(
    "loader",
    [
        ["data.align_to_bos=true", "train.micro_batch_tokens=64"],
        ["data.loader=documents", "data.doc_rule=packed", "train.micro_batch_tokens=64"],
        ["data.loader=documents", "data.doc_rule=stream", "train.micro_batch_tokens=64"],
    ],
)
def test_shards_without_a_document_start_are_not_called_too_small(no_document_starts, tmp_path, loader):
    """Shards of 100k tokens without one end-of-text token were reported as `too little data ...
    (largest shard has 98,000 tokens)`: the loaders that cut at document starts now say none exists."""
    eot = json.loads((no_document_starts / "meta.json").read_text())["eot_id"]
    got = run_speedrun(
        "train", "--out", str(tmp_path / "r"), *TINY, *SHORT, f"data.dir={no_document_starts}",
        f"model.eot_id={eot}", "train.global_batch_tokens=128", "train.seq_len=64", *loader,
    )  # fmt: skip
    err = one_line(got, 1, "no document start in 1 shard(s)", f"end-of-text id {eot}")
    assert "too little" not in err and "largest shard" not in err
    shutil.rmtree(tmp_path / "r", ignore_errors=True)


def test_an_ablation_switch_that_changes_only_reporting_is_refused(text_data, tmp_path):
    """`ablate ... train.log_every=3` trained the baseline twice and reported the difference between
    them as the switch's effect (it changes no loss, token count or training time)."""
    sets = [x for o in [*TINY, *SHORT, f"data.dir={text_data}"] for x in ("--set", o)]
    for switch in ("train.log_every=3", "train.checkpoint_every=2", "train.sample_every=5"):
        got = run_speedrun(
            "ablate", "--recipe", "demo", "--out", str(tmp_path / "ab"), "--seeds", "1", *sets, switch
        )
        one_line(got, 2, f"switch {switch} changes only what the runs report", "would repeat the baseline")
    assert not (tmp_path / "ab").exists()  # refused before anything trained


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A checkpoint of a tiny untrained model (save_checkpoint as the loop calls it)."""
    import torch

    from speedrun.model.gpt2024.model import GPT
    from speedrun.recipes import load_recipe
    from speedrun.train.run.checkpoint import save_checkpoint

    cfg = load_recipe("demo", TINY)
    return save_checkpoint(
        tmp_path / "run", 4, GPT(cfg.model), {"step": 4, "x": torch.ones(1)}, cfg.to_dict(), 0
    )


@pytest.mark.parametrize("missing", ["model.safetensors", "config.json"])
def test_a_checkpoint_missing_a_file_is_called_damaged(checkpoint, missing):
    """`sample CKPT` of a checkpoint folder without its weights said `the run has no checkpoint; train
    with train.checkpoint_at_end=true`: the folder was taken for a run because it lacked the weights."""
    (checkpoint / missing).unlink()
    for command in ("sample", "eval"):
        got = run_speedrun(command, str(checkpoint))
        one_line(got, 1, f"checkpoint {checkpoint} is damaged (missing file {missing})")


def test_misattributed_config_messages(tmp_path):
    """`model.n_layer=10000000000` blamed `model.max_seq_len=64 needs a 76,294 GiB position table` (the
    rotary tables are per layer); `--recipe FOLDER` said `recipe file not found`; a run folder whose lock
    file is a folder said `cannot write run directory RUN: Is a directory`, not which file."""
    got = run_speedrun("train", "--dry-run", *TINY, "model.n_layer=10000000000")
    one_line(got, 2, "model.max_seq_len=64 and model.n_layer=10000000000 (a rotary table per layer)")
    got = run_speedrun("train", "--dry-run", "--recipe", str(tmp_path))
    one_line(got, 2, f"recipe file {tmp_path} is a directory, not a .toml file")
    run = tmp_path / "run"
    (run / ".speedrun.lock").mkdir(parents=True)
    got = run_speedrun("train", "--out", str(run), *TINY, *SHORT)
    one_line(got, 1, f"cannot write run directory {run}/.speedrun.lock")
