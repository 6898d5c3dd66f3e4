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
