"""Streaming prepare: identical shards for any worker count and any file layout, bounded memory
(checked by counting live documents), --max-tokens against a full run, new input formats, and the
bad inputs of the streaming options, each one line on stderr with its exit code."""

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speedrun.cli import main
from speedrun.data import pipeline
from speedrun.data.meta import load_meta, shard_paths
from speedrun.data.prepare import prepare, prepare_documents
from speedrun.data.shards import open_shard
from speedrun.data.sources import iter_documents
from speedrun.errors import DataError
from tests.unit.test_prepare import make_docs


def run(source, out, **kw):
    return prepare(source, data_dir=out, log=lambda s: None, progress=False, **kw)


def shard_bytes(data_dir: Path) -> dict[str, list[bytes]]:
    meta = load_meta(data_dir)
    return {s: [(data_dir / n).read_bytes() for n in meta["splits"][s]["shards"]] for s in ("train", "val")}


def split_counts(data_dir: Path) -> dict:
    meta = load_meta(data_dir)
    return {s: {k: v for k, v in meta["splits"][s].items() if k != "shards"} for s in ("train", "val")}


def write_jsonl(path: Path, docs: list[str], gz: bool = False) -> None:
    data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    path.write_bytes(gzip.compress(data) if gz else data)


def write_parquet(path: Path, docs: list[str], row_group_size: int = 16, **extra) -> None:
    pq.write_table(pa.table({"text": docs, **extra}), path, row_group_size=row_group_size)


@pytest.fixture
def small_batches(monkeypatch):
    """Many tokenizer batches from a small corpus, so the pool and the window are exercised."""
    monkeypatch.setattr(pipeline, "BATCH_DOCS", 16)


@pytest.mark.slow
def test_one_and_two_workers_give_identical_shards(tmp_path, small_batches, monkeypatch):
    docs = make_docs(400)
    write_jsonl(tmp_path / "c.jsonl", docs)
    contexts = []
    real = pipeline.multiprocessing.get_context
    monkeypatch.setattr(pipeline.multiprocessing, "get_context", lambda m: contexts.append(m) or real(m))
    prepare_module = sys.modules[prepare.__module__]
    monkeypatch.setattr(prepare_module, "default_workers", lambda: 2)  # two workers on a one-core host too
    one = run(f"text:{tmp_path / 'c.jsonl'}", tmp_path / "one", workers=1, shard_tokens=1000)
    assert contexts == []  # one worker: encoded in this process
    two = run(f"text:{tmp_path / 'c.jsonl'}", tmp_path / "two", workers=2, shard_tokens=1000)
    assert contexts == ["spawn"]  # two workers: a process pool did the encoding
    assert len(shard_bytes(one)["train"]) > 3
    assert shard_bytes(one) == shard_bytes(two)
    assert (one / "meta.json").read_bytes() == (two / "meta.json").read_bytes()


def test_split_is_the_same_for_one_file_or_many_formats(tmp_path):
    docs = make_docs(300)
    write_jsonl(tmp_path / "all.jsonl", docs)
    many = tmp_path / "many"
    (many / "sub").mkdir(parents=True)
    write_jsonl(many / "a.jsonl.gz", docs[:90], gz=True)
    write_parquet(many / "b.parquet", docs[90:200], ids=list(range(110)))
    (many / "sub" / "c.txt.gz").write_bytes(gzip.compress("\n<|endoftext|>\n".join(docs[200:250]).encode()))
    (many / "sub" / "d.txt").write_text("\n<|endoftext|>\n".join(docs[250:]))
    assert list(iter_documents(f"text:{many}")) == docs
    a = run(f"text:{tmp_path / 'all.jsonl'}", tmp_path / "a", workers=1)
    b = run(f"text:{many}", tmp_path / "b", workers=1)
    assert shard_bytes(a) == shard_bytes(b) and split_counts(a) == split_counts(b)
    # the documented rule, computed independently: block i of 20 documents sends the one at
    # default_rng((seed, i)).choice(20, 1) to val (val_fraction 0.05 = 1/20)
    val = [
        docs[20 * i + int(np.random.default_rng((1337, i)).choice(20, 1, replace=False)[0])]
        for i in range(15)
    ]
    assert split_counts(a)["val"]["documents"] == 15
    assert split_counts(a)["val"]["bytes"] == sum(len(d.encode()) for d in val)


def test_memory_is_bounded_by_documents_alive(tmp_path, small_batches):
    """A corpus that cannot be materialized: the generator fails as soon as too many documents
    it produced are alive at once."""
    alive = {"now": 0, "max": 0}
    bound = 20 + 3 * 16  # one split block + a few tokenizer batches

    class Doc(str):
        def __del__(self):
            alive["now"] -= 1

    def corpus():
        for i, text in enumerate(make_docs(2000, seed=1)):
            alive["now"] += 1
            alive["max"] = max(alive["max"], alive["now"])
            if alive["now"] > bound:
                raise AssertionError(f"{alive['now']} documents alive at document {i}: corpus materialized")
            yield Doc(text)

    for tokenizer in ("gpt2", "bpe:300"):
        alive["max"] = 0
        out = prepare_documents(
            corpus, tmp_path / tokenizer.replace(":", ""), "custom", tokenizer, workers=1, log=lambda s: None
        )
        meta = load_meta(out)
        assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 2000
        assert 16 <= alive["max"] <= bound
    assert alive["now"] == 0


def test_max_tokens_stops_at_a_document_boundary(tmp_path, small_batches):
    docs = make_docs(300)
    write_jsonl(tmp_path / "c.jsonl", docs)
    full = run(f"text:{tmp_path / 'c.jsonl'}", tmp_path / "full", workers=1)
    cut = run(f"text:{tmp_path / 'c.jsonl'}", tmp_path / "cut", workers=1, max_tokens=2500)
    meta = load_meta(cut)
    total = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    n_docs = meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"]
    assert meta["max_tokens"] == 2500
    # the source order: the run stops after the first document at which the running count reaches 2,500
    running = np.cumsum([len(d) for d in _gpt2_lengths(docs)])
    assert n_docs == int(np.searchsorted(running, 2500)) + 1 and total == running[n_docs - 1]
    for split in ("train", "val"):  # each split is a prefix of the full run's
        a = np.concatenate([np.asarray(open_shard(p)) for p in shard_paths(cut, split)])
        b = np.concatenate([np.asarray(open_shard(p)) for p in shard_paths(full, split)])
        assert np.array_equal(a, b[: a.size])
    with pytest.raises(DataError, match="too few for a train/val split"):
        run(f"text:{tmp_path / 'c.jsonl'}", tmp_path / "tiny", workers=1, max_tokens=5)
    assert not (tmp_path / "tiny").exists()


def _gpt2_lengths(docs: list[str]) -> list[list[int]]:
    from speedrun.data.tokenizers import gpt2_tokenizer

    enc = gpt2_tokenizer().encoding  # plain tiktoken, one document at a time, plus its eot
    return [[0, *enc.encode_ordinary(d)] for d in docs]


def test_parquet_reads_a_row_group_at_a_time_and_skips_nulls(tmp_path):
    docs = make_docs(50)
    write_parquet(tmp_path / "p.parquet", [*docs[:10], None, "  ", *docs[10:]], row_group_size=7)
    assert pq.ParquetFile(tmp_path / "p.parquet").num_row_groups > 5
    assert list(iter_documents(f"text:{tmp_path / 'p.parquet'}")) == docs


# ----------------------------------------------------------------------------- bad inputs, via the CLI
def cli_error(capsys, *argv: str) -> tuple[int, str]:
    code = main(["prepare", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("speedrun: error:") and "Traceback" not in err[0], err
    return code, err[0]


def test_bad_inputs_end_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "notext.parquet")
    write_parquet(tmp_path / "good.parquet", make_docs(40))
    raw = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "corrupt.parquet").write_bytes(raw[:200] + bytes(64) + raw[264:])
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    good_gz = gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in make_docs(400)).encode())
    (tmp_path / "corrupt.jsonl.gz").write_bytes(good_gz[: len(good_gz) // 2])
    (tmp_path / "notgzip.txt.gz").write_bytes(b"plain text, not gzip")
    cases = [
        (["text:notext.parquet"], 1, 'no "text" column (columns: body)'),
        (["text:junk.parquet"], 1, "unreadable parquet file"),
        (["text:corrupt.parquet"], 1, "corrupt.parquet"),
        (["text:corrupt.jsonl.gz"], 1, "corrupt gzip data"),
        (["text:notgzip.txt.gz"], 1, "corrupt gzip data"),
        (["wiki-vital", "--workers", "0"], 2, "--workers must be at least 1"),
        (["wiki-vital", "--max-tokens", "0"], 2, "--max-tokens must be a positive"),
        (["wiki-vital", "--max-tokens", "-5"], 2, "--max-tokens must be a positive"),
        (["wiki-vital", "--tokenizer", "bpe:512", "--bpe-sample-mb", "0"], 2, "--bpe-sample-mb must be"),
        (["hf:not a dataset"], 2, "expected hf:OWNER/NAME[:CONFIG][@SPLIT]"),
    ]
    for argv, code, fragment in cases:
        got, line = cli_error(capsys, *argv)
        assert (got, fragment in line) == (code, True), (argv, line)
    assert [p for p in tmp_path.rglob("*") if p.name.startswith(".") or p.suffix in (".bin", ".json")] == []


def test_shard_writer_matches_write_shard_and_abort_leaves_nothing(tmp_path):
    from speedrun.data.shards import ShardWriter, write_shard

    tokens = np.random.default_rng(0).integers(0, 65536, 5000).astype(np.uint16)
    write_shard(tmp_path / "ref.bin", tokens)
    w = ShardWriter(tmp_path / "piecewise.bin")
    for part in np.array_split(tokens, 7):
        w.write(part)
    assert not (tmp_path / "piecewise.bin").exists()  # only a hidden temporary until closed
    w.close()
    assert (tmp_path / "piecewise.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    w = ShardWriter(tmp_path / "dropped.bin")
    w.write(tokens.astype(np.int64))
    w.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["piecewise.bin", "ref.bin"]
    with pytest.raises(DataError, match="do not fit"):
        ShardWriter(tmp_path / "big.bin").write(np.array([70000]))
