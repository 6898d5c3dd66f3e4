"""prepare: text sources, the seeded by-document split, shards and meta.json checked against the
source documents encoded independently, bpe:N trained on train only, and atomic installation."""

import json
from pathlib import Path

import numpy as np
import pytest

from speedrun.data import pipeline
from speedrun.data.meta import check_tokenizer, default_data_dir, load_meta, shard_paths, tokenizer_for_data
from speedrun.data.prepare import prepare
from speedrun.data.shards import open_shard, read_header
from speedrun.data.sources import iter_documents, source_slug, wiki_vital_path
from speedrun.data.tokenizers import load_tokenizer, train_bpe_tokenizer
from speedrun.errors import ConfigError, DataError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"Document {i}: " + " ".join(rng.choice(WORDS, size=5 + i % 40)) + " é🎉" for i in range(n)]


@pytest.fixture
def corpus(tmp_path):
    docs = make_docs(200)
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, docs


def split_docs(data_dir: Path, split: str, tok) -> list[list[int]]:
    """Concatenate a split's shards and cut at every eot: each piece is one document's ids."""
    stream = np.concatenate([np.asarray(open_shard(p)) for p in shard_paths(data_dir, split)])
    assert stream[0] == tok.eot_id  # every document starts with eot, so the stream does too
    starts = list(np.flatnonzero(stream == tok.eot_id)) + [len(stream)]
    return [stream[a + 1 : b].tolist() for a, b in zip(starts, starts[1:], strict=False)]


def run(source, out, **kw):
    return prepare(source, data_dir=out, log=lambda s: None, **kw)


def test_split_by_document_and_meta(tmp_path, corpus):
    path, docs = corpus
    out = run(f"text:{path}", tmp_path / "d", shard_tokens=500)
    meta = load_meta(out)
    tok = load_tokenizer("gpt2")
    encoded = {tuple(tok.encode(d)): d for d in docs}
    assert len(encoded) == len(docs)
    seen = {}
    for split in ("train", "val"):
        pieces = split_docs(out, split, tok)
        texts = [encoded[tuple(p)] for p in pieces]  # KeyError if a document were cut or altered
        seen[split] = texts
        info = meta["splits"][split]
        assert info["documents"] == len(texts)
        assert info["bytes"] == sum(len(t.encode()) for t in texts)
        assert (
            info["tokens"]
            == sum(read_header(out / n) for n in info["shards"])
            == sum(len(p) + 1 for p in pieces)
        )
        assert info["shards"][0] == f"text-corpus_{split}_000000.bin"
        assert len(info["shards"]) == -(-info["tokens"] // 500)  # documents continue across shards
        # within a split, documents keep their source order
        assert [docs.index(t) for t in texts] == sorted(docs.index(t) for t in texts)
    assert set(seen["train"]).isdisjoint(seen["val"])
    assert sorted(seen["train"] + seen["val"]) == sorted(docs)
    assert len(seen["val"]) == 10  # round(0.05 * 200)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_id"]) == ("gpt2", 50257, 50256)
    assert meta["tokenizer_hash"] == tok.hash and meta["source"] == f"text:{path}"
    assert tokenizer_for_data(out).hash == tok.hash


def test_split_is_deterministic_and_seeded(tmp_path, corpus):
    path, _ = corpus
    a = run(f"text:{path}", tmp_path / "a")
    b = run(f"text:{path}", tmp_path / "b")
    c = run(f"text:{path}", tmp_path / "c", seed=7)
    for name in load_meta(a)["splits"]["val"]["shards"] + load_meta(a)["splits"]["train"]["shards"]:
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "text-corpus_val_000000.bin").read_bytes() != (c / "text-corpus_val_000000.bin").read_bytes()


def test_bpe_prepare_trains_on_train_split_only(tmp_path, corpus):
    path, docs = corpus
    out = run(f"text:{path}", tmp_path / "bpe", tokenizer="bpe:300")
    meta = load_meta(out)
    tok = tokenizer_for_data(out)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_id"]) == ("bpe:300", 300, 299)
    train_texts = [tok.decode(p) for p in split_docs(out, "train", tok)]
    assert set(train_texts) < set(docs)
    assert train_bpe_tokenizer(train_texts, 300).hash == meta["tokenizer_hash"]
    assert train_bpe_tokenizer(docs, 300).hash != meta["tokenizer_hash"]  # val text would change it
    with pytest.raises(DataError, match="tokenized with 'bpe:300'"):
        check_tokenizer(meta, load_tokenizer("gpt2"), out)


def test_wiki_vital_gpt2(tmp_path):
    out = run("wiki-vital", tmp_path / "wiki")
    meta = load_meta(out)
    articles = json.loads(wiki_vital_path().read_text())
    texts = [articles[t]["extract"] for t in sorted(articles) if articles[t]["extract"].strip()]
    s = meta["splits"]
    assert s["train"]["documents"] + s["val"]["documents"] == len(texts) > 9000
    assert s["train"]["bytes"] + s["val"]["bytes"] == sum(len(t.encode()) for t in texts)
    total = s["train"]["tokens"] + s["val"]["tokens"]
    assert 900_000 < total < 1_150_000
    assert list(iter_documents("wiki-vital"))[:50] == texts[:50]
    for split in ("train", "val"):
        tokens = open_shard(out / s[split]["shards"][0], vocab_size=50257)
        assert tokens[0] == 50256 and int(np.count_nonzero(tokens == 50256)) == s[split]["documents"]


def test_interrupted_prepare_leaves_nothing_complete(tmp_path, corpus, monkeypatch):
    path, _ = corpus
    calls = []
    real_writer = pipeline.ShardWriter

    class FailingWriter(real_writer):
        def close(self):  # the second shard to be finished fails
            calls.append(self.path)
            if len(calls) == 2:
                raise KeyboardInterrupt
            super().close()

    monkeypatch.setattr(pipeline, "ShardWriter", FailingWriter)
    with pytest.raises(KeyboardInterrupt):
        run(f"text:{path}", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]  # temp folder removed too
    with pytest.raises(DataError, match="speedrun prepare"):
        load_meta(tmp_path / "out")

    # an earlier complete folder survives an interrupted re-prepare untouched
    monkeypatch.setattr(pipeline, "ShardWriter", real_writer)
    out = run(f"text:{path}", tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls.clear()
    monkeypatch.setattr(pipeline, "ShardWriter", FailingWriter)
    with pytest.raises(KeyboardInterrupt):
        run(f"text:{path}", tmp_path / "out", seed=5)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_reprepare_replaces_but_never_clobbers_foreign_folders(tmp_path, corpus):
    path, _ = corpus
    out = run(f"text:{path}", tmp_path / "out")
    run(f"text:{path}", out, seed=9)
    assert load_meta(out)["seed"] == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "out"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("precious")
    with pytest.raises(DataError, match="not a prepared data folder"):
        run(f"text:{path}", mine)
    assert (mine / "thesis.txt").read_text() == "precious"


def test_load_meta_errors(tmp_path, corpus):
    with pytest.raises(DataError, match="speedrun prepare"):
        load_meta(tmp_path / "nothing")
    path, _ = corpus
    out = run(f"text:{path}", tmp_path / "d")
    meta_path = out / "meta.json"
    good = meta_path.read_text()
    meta_path.write_text("{broken")
    with pytest.raises(DataError, match="invalid"):
        load_meta(out)
    meta_path.write_text(good)
    (out / json.loads(good)["splits"]["val"]["shards"][0]).unlink()
    with pytest.raises(DataError, match="missing"):
        load_meta(out)
    meta_path.unlink()
    with pytest.raises(DataError, match="meta.json"):
        load_meta(out)


def test_default_data_dir_and_argument_errors(tmp_path):
    assert default_data_dir("wiki-vital", "gpt2") == Path("data/wiki-vital")
    assert default_data_dir("wiki-vital", "bpe:4096") == Path("data/wiki-vital-bpe4096")
    assert default_data_dir("text:/x/my_notes.jsonl", "gpt2") == Path("data/text-my-notes")
    assert default_data_dir("fineweb10B", "gpt2") == Path("data/fineweb10B")
    with pytest.raises(ConfigError, match="wiki-vital"):
        run("wikipedia", tmp_path / "x")
    with pytest.raises(ConfigError):
        run("wiki-vital", tmp_path / "x", tokenizer="bpe:12")
    with pytest.raises(ConfigError, match="gpt2"):
        run("fineweb10B:2", tmp_path / "x", tokenizer="bpe:4096")
    with pytest.raises(ConfigError, match="positive"):
        run("fineweb10B:0", tmp_path / "x")
    with pytest.raises(ConfigError, match="val_fraction"):
        run("wiki-vital", tmp_path / "x", val_fraction=1.5)
    one = tmp_path / "one.txt"
    one.write_text("a single document")
    with pytest.raises(DataError, match="at least 2 documents"):
        run(f"text:{one}", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_fineweb_source_is_dispatched(tmp_path, monkeypatch):
    from speedrun.data import fineweb

    calls = []
    monkeypatch.setattr(fineweb, "download_fineweb", lambda n, d, log: calls.append((n, d)) or d)
    assert run("fineweb10B:3", tmp_path / "fw") == tmp_path / "fw"
    assert run("fineweb10B", tmp_path / "fw") == tmp_path / "fw"
    assert calls == [(3, tmp_path / "fw"), (9, tmp_path / "fw")]


# ------------------------------------------------------------------ text sources
def test_text_sources(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("first doc\n<|endoftext|>\nsecond doc\nline 2\n<|endoftext|>\n\n")
    (tmp_path / "b" / "c.jsonl").write_text('{"text": "third"}\n\n{"text": "  "}\n{"text": "fourth"}\n')
    (tmp_path / "b" / "ignored.md").write_text("not read")
    (tmp_path / "z.txt").write_text("whole file <|endoftext|> inline is text\n")
    assert list(iter_documents(f"text:{tmp_path}")) == [
        "first doc",
        "second doc\nline 2",
        "third",
        "fourth",
        "whole file <|endoftext|> inline is text",
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(DataError, match=f"{bad}:2"):
        list(iter_documents(f"text:{bad}"))
    with pytest.raises(DataError, match="not found"):
        iter_documents(f"text:{tmp_path / 'missing.txt'}")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match="UTF-8"):
        list(iter_documents(f"text:{tmp_path / 'latin1.txt'}"))
    with pytest.raises(ConfigError, match="wiki-vital"):
        iter_documents("nope")
    assert source_slug(f"text:{tmp_path}/") == "text-" + tmp_path.name.replace("_", "-")


@pytest.mark.slow
def test_a_folder_a_run_trains_from_is_not_prepared_again_under_it(text_data, data_copy, tmp_path):
    """Preparing a folder again while a run trained from it switched the run's validation data (val
    loss 2.2 -> 8.7, exit 0). A real run in another process holds the folder: prepare is refused in
    one line, exit 1, before any work; once the run has stopped, the same command replaces it."""
    import signal
    import subprocess

    from tests.conftest import TINY, run_speedrun, speedrun_command, wait_for_metrics

    out = tmp_path / "run"
    args = [
        "train",
        "--out",
        str(out),
        *TINY,
        f"data.dir={data_copy}",
        "train.steps=100000",
        "train.val_every=0",
    ]
    proc = subprocess.Popen(
        speedrun_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for_metrics(out, 2)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        before = sorted(p.name for p in data_copy.iterdir())
        again = ["prepare", f"text:{text_data.parent / 'docs.jsonl'}", "--tokenizer", "bpe:512"]
        got = run_speedrun(*again, "--data-dir", str(data_copy), "--max-tokens", "9000")
        assert got.returncode == 1, got
        assert got.stderr.count("\n") == 1 and "a training run is reading this data folder" in got.stderr
        assert (
            sorted(p.name for p in data_copy.iterdir()) == before
            and load_meta(data_copy)["max_tokens"] is None
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    got = run_speedrun(*again, "--data-dir", str(data_copy), "--max-tokens", "9000")
    assert got.returncode == 0, got.stderr
    assert load_meta(data_copy)["max_tokens"] == 9000


def test_a_run_starting_during_the_rename_locks_the_new_folder(tmp_path):
    """The race the lock closes: a run that takes its lock while prepare renames waits, then holds
    the folder that is there now, not the one moved away."""
    import os
    import threading

    from speedrun.data.folder_lock import hold_for_training, replacing

    folder, new = tmp_path / "data", tmp_path / "new"
    folder.mkdir()
    new.mkdir()
    got = []
    with replacing(folder):
        thread = threading.Thread(target=lambda: got.append(hold_for_training(folder)))
        thread.start()
        thread.join(0.3)
        assert thread.is_alive()  # waiting for the rename
        os.replace(folder, tmp_path / "old")
        os.replace(new, folder)
    thread.join(10)
    assert os.fstat(got[0]).st_ino == os.stat(folder).st_ino
    with pytest.raises(DataError, match="a training run is reading this data folder"), replacing(folder):
        pass
    os.close(got[0])
    with replacing(folder):  # released with the run
        pass
