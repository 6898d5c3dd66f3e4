"""Four cases of an earlier hidden round that still went wrong (issue 27), each fixed where its rule
lives: summary.json's step count of a stopped run, meta.json numbers against the tokenizer they copy,
dictionary-encoded parquet text, and `prepare` options a source does not use."""

from __future__ import annotations

import json
import os
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speedrun.cli import main
from speedrun.errors import DataError
from speedrun.recipes import load_recipe
from tests.conftest import TINY


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("speedrun: error:") and "Traceback" not in err[0], err
    return err[0]


def test_a_stopped_run_reports_the_steps_it_trained(text_data, tmp_path, monkeypatch):
    """Stopped by SIGTERM after 8 of 20 steps: summary.json (which compare, verify and ablate read) said
    20 steps (`train.steps`) and derived its tokens/s from the whole plan."""
    from speedrun.tools.results import load_run
    from speedrun.train import loop
    from speedrun.train.signals import RunInterrupted

    real, done = loop.train_step, []

    def step_then_stop(*args, **kwargs):
        loss = real(*args, **kwargs)
        done.append(1)
        if len(done) == 8:
            os.kill(os.getpid(), signal.SIGTERM)  # the run's handler asks for a stop at this step's end
        return loss

    monkeypatch.setattr(loop, "train_step", step_then_stop)
    overrides = [*TINY, f"data.dir={text_data}", "train.steps=20", "train.warmdown_steps=5"]
    cfg = load_recipe("demo", overrides)
    with pytest.raises(RunInterrupted):
        loop.train(cfg, tmp_path / "r")
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("stopped", 8)
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in metrics if "train_loss" in r) == 8
    assert load_run(tmp_path / "r").steps == 8


def test_meta_numbers_that_disagree_with_the_tokenizer_are_refused(data_copy, tmp_path, capsys):
    """meta.json vocab_size 600 beside a bpe:512 tokenizer.json: a model of 600 rows trained on it."""
    meta = json.loads((data_copy / "meta.json").read_text())
    assert meta["vocab_size"] == 512
    (data_copy / "meta.json").write_text(json.dumps({**meta, "vocab_size": 600}))
    argv = ["train", "--out", str(tmp_path / "r"), f"data.dir={data_copy}", *TINY, "model.vocab_size=600"]
    assert main(argv) == 1
    line = _one_error_line(capsys)
    assert "meta.json" in line and "vocab_size 600" in line and "512" in line, line
    metrics = tmp_path / "r" / "metrics.jsonl"
    assert not metrics.exists() or "train_loss" not in metrics.read_text()  # refused before any step


def test_dictionary_encoded_parquet_text_is_read(tmp_path):
    """pandas categoricals and many writers store repeated strings dictionary-encoded; they are text."""
    from speedrun.data.sources import iter_file

    docs = [f"document {i % 3} about the same few things." for i in range(20)]
    path = tmp_path / "dict.parquet"
    pq.write_table(pa.table({"text": pa.array(docs).dictionary_encode()}), path, row_group_size=7)
    assert pa.types.is_dictionary(pq.ParquetFile(path).schema_arrow.field("text").type)
    assert list(iter_file(path)) == docs
    pq.write_table(pa.table({"text": pa.array([1, 2]).dictionary_encode()}), tmp_path / "ints.parquet")
    with pytest.raises(DataError, match="not strings"):  # numbers are still no text
        list(iter_file(tmp_path / "ints.parquet"))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["hellaswag", "--max-tokens", "5"], "--max-tokens"),
        (["hellaswag", "--workers", "2"], "--workers"),
        (["hellaswag", "--tokenizer", "gpt2"], "--tokenizer"),
        (["hellaswag", "--bpe-sample-mb", "5"], "--bpe-sample-mb"),
        (["fineweb10B:1", "--max-tokens", "5"], "--max-tokens"),
        (["fineweb10B:1", "--workers", "2"], "--workers"),
        (["wiki-vital", "--bpe-sample-mb", "5"], "--bpe-sample-mb"),
    ],
)
def test_a_prepare_option_the_source_does_not_use_is_usage(argv, flag, tmp_path, capsys, monkeypatch):
    """`prepare hellaswag --max-tokens 5` downloaded all of HellaSwag (or failed offline, exit 1)."""
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", *argv]) == 2
    line = _one_error_line(capsys)
    assert flag in line, line
    assert list(tmp_path.iterdir()) == []
