"""The .bin shard format: byte layout against an independent struct-based writer, and every way a
file can be wrong raises a DataError that names the file."""

import os
import struct

import numpy as np
import pytest

from speedrun.data import shards
from speedrun.data.shards import open_shard, read_header, write_shard
from speedrun.errors import DataError


def reference_bytes(tokens) -> bytes:
    """The modded-nanogpt layout written by hand: 256 little-endian int32, then little-endian uint16."""
    header = struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253))
    return header + struct.pack(f"<{len(tokens)}H", *[int(t) for t in tokens])


def test_round_trip_matches_reference_layout(tmp_path):
    rng = np.random.default_rng(0)
    tokens = np.concatenate([[0, 65535, 50256], rng.integers(0, 65536, 1000)]).astype(np.int64)
    path = tmp_path / "x_train_000000.bin"
    write_shard(path, tokens)
    assert path.read_bytes() == reference_bytes(tokens)
    assert read_header(path) == len(tokens)
    mapped = open_shard(path)
    assert isinstance(mapped, np.memmap)
    np.testing.assert_array_equal(mapped, tokens)
    with pytest.raises(ValueError):
        mapped[0] = 1  # read-only map


def test_reads_a_file_written_by_the_reference(tmp_path):
    tokens = [5, 4, 3, 2, 1, 60000]
    path = tmp_path / "ref.bin"
    path.write_bytes(reference_bytes(tokens))
    np.testing.assert_array_equal(open_shard(path, vocab_size=60001), tokens)


def test_empty_shard(tmp_path):
    path = tmp_path / "empty.bin"
    write_shard(path, np.zeros(0, dtype=np.uint16))
    assert read_header(path) == 0
    assert len(open_shard(path, vocab_size=10)) == 0


def _corrupt(path, kind):
    data = bytearray(reference_bytes(list(range(100))))
    if kind == "magic":
        data[0:4] = struct.pack("<i", 12345)
    elif kind == "version":
        data[4:8] = struct.pack("<i", 2)
    elif kind == "truncated":
        data = data[:-2]
    elif kind == "overlong":
        data += b"\x00\x00"
    elif kind == "short":
        data = data[:1000]
    elif kind == "empty":
        data = b""
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "kind, words",
    [
        ("magic", "magic"),
        ("version", "version"),
        ("truncated", "truncated"),
        ("overlong", "overlong"),
        ("short", "shorter than"),
        ("empty", "shorter than"),
    ],
)
def test_corrupt_files_raise_data_error_naming_file(tmp_path, kind, words):
    path = tmp_path / f"bad_{kind}.bin"
    _corrupt(path, kind)
    for fn in (read_header, open_shard):
        with pytest.raises(DataError) as err:
            fn(path)
        assert str(path) in str(err.value) and words in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_header(tmp_path / "nope.bin")


def test_out_of_range_id_names_file_and_id(tmp_path):
    path = tmp_path / "ids.bin"
    write_shard(path, np.array([1, 2, 3, 4096, 5]))
    np.testing.assert_array_equal(open_shard(path, vocab_size=4097), [1, 2, 3, 4096, 5])
    with pytest.raises(DataError) as err:
        open_shard(path, vocab_size=4096)
    assert str(path) in str(err.value) and "4096" in str(err.value)


def test_out_of_range_scan_crosses_blocks(tmp_path, monkeypatch):
    """The range check scans in blocks; a bad id in a later block must still be found."""
    monkeypatch.setattr(shards, "SCAN_BLOCK", 8)
    tokens = np.zeros(50, dtype=np.int64)
    tokens[47] = 9
    tokens[3] = 8
    path = tmp_path / "blocks.bin"
    write_shard(path, tokens)
    mapped = open_shard(path)
    shards.check_token_range(mapped, 10, path)
    with pytest.raises(DataError, match="token id 9 .*first bad token at 47"):
        shards.check_token_range(mapped, 9, path)


@pytest.mark.parametrize("bad", [65536, 70000, -1])
def test_write_refuses_ids_outside_uint16(tmp_path, bad):
    path = tmp_path / "big.bin"
    with pytest.raises(DataError) as err:
        write_shard(path, np.array([1, bad, 2]))
    assert str(path) in str(err.value) and str(bad) in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "a_train_000000.bin"
    write_shard(path, np.arange(10))
    before = path.read_bytes()

    def boom(fd):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk on fire"):
        write_shard(path, np.arange(20))
    assert path.read_bytes() == before  # the old file is untouched
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # and no temporary file is left
    with pytest.raises(OSError):
        write_shard(tmp_path / "new.bin", np.arange(5))
    assert not (tmp_path / "new.bin").exists()
