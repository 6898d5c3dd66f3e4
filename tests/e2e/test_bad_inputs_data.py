"""Bad inputs and faults of prepare and the data folder: meta.json against the shards, links, mount points,
odd sources and names (docs/bad-inputs.md): each ends in one stderr line and exit 1 or 2, or works;
nothing we do not own is lost, nothing is silently wrong."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speedrun.cli import main
from speedrun.config.data import parse_fineweb_source
from speedrun.errors import ConfigError, DataError
from tests.bad_input_runs import (
    FAST,
    SHORT,
    XFF,
    _edit_meta,
    _main_on_a_terminal,
    _one_error_line,
    _train,
    error_line,
    one_line,
)
from tests.conftest import TINY, run_speedrun


def test_prepare_into_a_link_to_a_folder_fills_the_folder_and_keeps_the_link(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 30}) + "\n" for i in range(50)))
    disk = tmp_path / "big-disk" / "shards"
    disk.mkdir(parents=True)
    link = tmp_path / "data"
    link.symlink_to(disk)
    proc = run_speedrun("prepare", f"text:{src}", "--tokenizer", "bpe:300", "--data-dir", str(link))
    assert proc.returncode == 0, proc.stderr
    assert link.is_symlink() and link.resolve() == disk.resolve()
    assert (disk / "meta.json").is_file()
    run_speedrun("prepare", f"text:{src}", "--tokenizer", "bpe:300", "--data-dir", str(link))
    assert link.is_symlink() and (disk / "meta.json").is_file()  # prepared again: still the link


def test_prepare_into_a_mount_point_fails_before_any_work(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        src = tmp_path / "docs.jsonl"
        src.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(50)))
        proc = run_speedrun("prepare", f"text:{src}", "--tokenizer", "bpe:300", "--data-dir", str(mnt))
        one_line(proc, 1, "is a mount point", f"--data-dir {mnt / 'data'}")
        assert "prepare text:" not in proc.stdout  # refused before tokenizing anything
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_a_meta_json_that_trains_on_the_val_shards_is_refused(finished, data_copy, tmp_path):
    val = json.loads((data_copy / "meta.json").read_text())["splits"]["val"]

    def train_on_val(splits):
        splits["train"]["shards"] += val["shards"]
        splits["train"]["tokens"] += val["tokens"]  # counts agree with the headers: only the overlap is wrong

    _edit_meta(data_copy, train_on_val)
    proc = run_speedrun("train", "--out", str(tmp_path / "run"), f"data.dir={data_copy}", *FAST)
    one_line(proc, 1, "meta.json", "listed under both train and val")
    one_line(run_speedrun("eval", str(finished), "--data", str(data_copy)), 1, "listed under both")


def test_meta_json_counts_must_agree_with_the_shard_headers(data_copy, tmp_path):
    def inflate(splits):
        splits["val"]["tokens"] *= 10

    _edit_meta(data_copy, inflate)
    proc = run_speedrun("train", "--out", str(tmp_path / "run"), f"data.dir={data_copy}", *FAST)
    one_line(proc, 1, "meta.json", "says the val split holds", "its shards' headers hold")


def test_prepare_with_a_source_and_folder_named_in_other_bytes(text_data, tmp_path):
    source = tmp_path / f"s{XFF}.jsonl"
    shutil.copy(text_data.parent / "docs.jsonl", source)
    data = tmp_path / f"d{XFF}"
    code, out, err = _main_on_a_terminal(
        "prepare", f"text:{source}", "--data-dir", str(data), "--max-tokens", "20000"
    )
    assert code == 0, err
    assert f"prepared text:{tmp_path}/s\\xff.jsonl in {tmp_path}/d\\xff" in out  # (before: a traceback)
    assert json.loads((data / "meta.json").read_bytes())["source"] == f"text:{source}"  # reads back exactly


def test_a_data_folder_that_is_a_file_is_named_a_file(tmp_path):
    file = tmp_path / "docs.jsonl"
    file.write_text("{}\n")
    proc = run_speedrun("train", "--out", str(tmp_path / "run"), f"data.dir={file}", *FAST)
    assert proc.returncode == 1
    # (before: "data folder not found; run `speedrun prepare SOURCE --data-dir FILE`", which refuses it)
    assert proc.stderr == f"speedrun: error: {file}: is a file, not a data folder made by speedrun prepare\n"


def test_prepare_into_the_current_folder(text_data, tmp_path):
    """`--data-dir .` (an empty folder one stands in): the shards land there (before: the temporary
    folder was made inside it, and after all the work prepare refused to replace a folder holding it)."""
    here = tmp_path / "here"
    here.mkdir()
    source = f"text:{text_data.parent / 'docs.jsonl'}"
    proc = run_speedrun("prepare", source, "--data-dir", ".", "--max-tokens", "20000", cwd=here)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((here / "meta.json").read_text())["source"] == source


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


def test_a_prepared_folders_temporary_name_is_counted(tmp_path):
    """prepare builds `.NAME.tmp-XXXXXXXX` beside the target: a 250-byte name fits the folder but not
    that, and failed as `File name too long` on a name the user never gave."""
    got = run_speedrun(
        "prepare", "wiki-vital", "--tokenizer", "bpe:300", "--data-dir", str(tmp_path / ("d" * 250))
    )
    error_line(got, 2, "--data-dir", "is 250 bytes", "allows 241")


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
    err = error_line(got, 1, "no document start in 1 shard(s)", f"end-of-text id {eot}")
    assert "too little" not in err and "largest shard" not in err
    shutil.rmtree(tmp_path / "r", ignore_errors=True)


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


def test_fineweb_shard_count_is_bounded_by_the_dataset():
    """kjj0/fineweb10B-gpt2 has train shards 1..103 (modded-nanogpt's cached_fineweb10B.py default):
    asking for more failed only after downloading all 103."""
    assert parse_fineweb_source("fineweb10B:103") == 103
    with pytest.raises(ConfigError, match="at most 103"):
        parse_fineweb_source("fineweb10B:104")


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


def test_a_killed_prepare_s_temporary_folder_is_removed_and_a_running_one_refused(tmp_path):
    """issue 46: a prepare killed with SIGKILL left `.NAME.tmp-XXXX` that nothing mentioned, and two
    prepares into one folder at once both reported success. The next prepare removes a dead one's folder
    (saying so) and refuses while a live one builds; an unmarked older folder is named, not touched."""
    import sys

    from speedrun.data.prepare import OWNER, prepare
    from speedrun.errors import DataError

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document number {i} " * 40}) + "\n" for i in range(200)))
    target = tmp_path / "shards"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    killed = tmp_path / ".shards.tmp-killed1"
    killed.mkdir()
    (killed / OWNER).write_text(dead.stdout.strip())  # a process that has ended: its prepare was killed
    unmarked = tmp_path / ".shards.tmp-older01"
    unmarked.mkdir()
    said: list[str] = []
    prepare(f"text:{src}", "bpe:512", target, log=lambda *a: said.append(" ".join(map(str, a))))
    assert not killed.exists() and unmarked.exists() and (target / "meta.json").is_file()
    assert not (target / OWNER).exists()
    assert any(f"removed {killed}" in s for s in said) and any(str(unmarked) in s for s in said), said
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / ".other.tmp-running"
        busy.mkdir()
        (busy / OWNER).write_text(str(live.pid))
        with pytest.raises(DataError, match=rf"another prepare \(process {live.pid}\) is writing"):
            prepare(f"text:{src}", "bpe:512", tmp_path / "other", log=lambda *a: None)
        assert busy.exists() and not (tmp_path / "other").exists()
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("prefetch", [False, True], ids=["cpu", "prefetch-thread"])
def test_a_shard_rewritten_under_the_loader_is_a_data_error_and_a_renamed_one_is_read_as_opened(
    tmp_path, prefetch
):
    """The loaders read shards slice by slice from an open file (data/shards.py `ShardFile`), not through a
    map: a shard cut or rewritten in place while a run reads it is one DataError naming it (before: the
    mapped run died of SIGBUS with nothing on stderr), with the same size as well (its modification time);
    a shard replaced by a rename keeps being read as the run opened it."""
    import numpy as np

    from speedrun.data.loader import TokenLoader
    from speedrun.data.shards import write_shard

    tokens = np.arange(4096, dtype=np.uint16) % 500
    for how in ("truncate", "same-size", "rename"):
        path = tmp_path / how / "d_train_000000.bin"
        write_shard(path, tokens)
        loader = TokenLoader([path], 256, 128, 64, prefetch=prefetch)
        x, _ = loader.next_batch()
        np.testing.assert_array_equal(x.flatten().numpy(), tokens[:128])
        if how == "truncate":
            with open(path, "r+b") as f:
                f.truncate(2048)
        elif how == "same-size":
            os.utime(path, ns=(0, 0))  # an in-place rewrite moves the modification time
        else:
            write_shard(path.with_suffix(".new"), tokens[::-1].copy())
            os.replace(path.with_suffix(".new"), path)
        if how == "rename":
            for k in range(1, 4):
                x, _ = loader.next_batch()
                np.testing.assert_array_equal(x.flatten().numpy(), tokens[128 * k : 128 * (k + 1)])
            continue
        with pytest.raises(DataError) as e:
            for _ in range(3):
                loader.next_batch()
        assert str(e.value).startswith(
            f"{path}: the shard changed while the run read it"
        ) and "\n" not in str(e.value)
