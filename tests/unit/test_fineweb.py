"""FineWeb download through huggingface_hub against a local stand-in Hub server (no network):
files arrive intact and validated, meta.json describes them, and failures become DataErrors."""

import hashlib

import numpy as np
import pytest

from speedrun.data.fineweb import download_fineweb
from speedrun.data.meta import load_meta
from speedrun.data.shards import read_header, write_shard
from speedrun.data.tokenizers import load_tokenizer
from speedrun.errors import DataError
from tests.local_server import LocalServer, QuietHandler

REPO = "someone/fineweb-mini"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class StandInHub:
    """Serves `files` at /datasets/<repo>/resolve/<rev>/<name> with the headers hf_hub_download needs;
    `status` forces an HTTP error code for a file name."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.status: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(QuietHandler):
            def respond(self, body: bool):
                hub.requests.append((self.command, self.path))
                prefix = f"/datasets/{REPO}/resolve/"
                name = self.path[len(prefix) :].split("/", 1)[-1] if self.path.startswith(prefix) else ""
                code = hub.status.get(name, 200 if name in hub.files else 404)
                data = hub.files.get(name, b"") if code == 200 else b"error"
                self.send_response(code)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                if code == 404:
                    self.send_header("X-Error-Code", "EntryNotFound")
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.http = LocalServer(Handler)
        self.url = self.http.url

    def close(self):
        self.http.close()


@pytest.fixture
def hub(tmp_path):
    hub = StandInHub()
    rng = np.random.default_rng(0)
    for i, name in enumerate(
        ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    ):
        tokens = rng.integers(0, 50257, 3000 + 100 * i)
        tokens[rng.choice(len(tokens), 10 + i, replace=False)] = 50256
        tokens[0] = 50256
        write_shard(tmp_path / "src" / name, tokens)
        hub.files[name] = (tmp_path / "src" / name).read_bytes()
    yield hub
    hub.close()


@pytest.fixture
def no_backoff(monkeypatch):
    """huggingface_hub retries 5xx / connection errors with sleeps of up to ~23 s in all; skip the waits."""
    import huggingface_hub.utils._http as hf_http

    monkeypatch.setattr(hf_http.time, "sleep", lambda s: None)


def test_download_validates_and_writes_meta(tmp_path, hub):
    out = tmp_path / "fineweb10B"
    assert download_fineweb(2, out, repo_id=REPO, endpoint=hub.url, log=lambda s: None) == out
    for name, data in hub.files.items():
        assert (out / name).read_bytes() == data
    meta = load_meta(out)
    gpt2 = load_tokenizer("gpt2")
    assert (meta["tokenizer"], meta["tokenizer_hash"]) == ("gpt2", gpt2.hash)
    assert (meta["vocab_size"], meta["eot_id"], meta["source"]) == (50257, 50256, "fineweb10B:2")
    assert meta["splits"]["val"]["shards"] == ["fineweb_val_000000.bin"]
    assert meta["splits"]["train"]["shards"] == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    for split in ("train", "val"):
        info = meta["splits"][split]
        assert info["tokens"] == sum(read_header(out / n) for n in info["shards"])
        assert "bytes" not in info
    eots = [
        int(np.count_nonzero(np.frombuffer(hub.files[n][1024:], "<u2") == 50256)) for n in sorted(hub.files)
    ]
    assert meta["splits"]["train"]["documents"] == eots[0] + eots[1]
    assert meta["splits"]["val"]["documents"] == eots[2]

    # a second run with the files present re-validates and rewrites meta without re-downloading bodies
    hub.requests.clear()
    download_fineweb(1, out, repo_id=REPO, endpoint=hub.url, log=lambda s: None)
    assert not any(method == "GET" for method, _ in hub.requests)
    assert load_meta(out)["splits"]["train"]["shards"] == ["fineweb_train_000001.bin"]


def test_corrupt_download_is_rejected(tmp_path, hub):
    hub.files["fineweb_train_000001.bin"] = hub.files["fineweb_train_000001.bin"][:-10]
    out = tmp_path / "fw"
    with pytest.raises(DataError) as err:
        download_fineweb(1, out, repo_id=REPO, endpoint=hub.url, log=lambda s: None)
    assert "fineweb_train_000001.bin" in str(err.value) and "truncated" in str(err.value)
    assert not (out / "meta.json").exists() and not (out / "fineweb_train_000001.bin").exists()


def test_out_of_vocab_download_is_rejected(tmp_path, hub):
    write_shard(tmp_path / "bad.bin", np.array([50256, 1, 60000]))
    hub.files["fineweb_val_000000.bin"] = (tmp_path / "bad.bin").read_bytes()
    with pytest.raises(DataError, match="60000"):
        download_fineweb(1, tmp_path / "fw", repo_id=REPO, endpoint=hub.url, log=lambda s: None)


def test_missing_file_is_a_data_error(tmp_path, hub):
    with pytest.raises(DataError) as err:
        download_fineweb(3, tmp_path / "fw", repo_id=REPO, endpoint=hub.url, log=lambda s: None)
    assert "fineweb_train_000003.bin" in str(err.value) and REPO in str(err.value)
    assert not (tmp_path / "fw" / "meta.json").exists()


def test_server_error_is_a_data_error(tmp_path, hub, no_backoff):
    hub.status["fineweb_val_000000.bin"] = 500
    with pytest.raises(DataError, match="fineweb_val_000000.bin.*500"):
        download_fineweb(1, tmp_path / "fw", repo_id=REPO, endpoint=hub.url, log=lambda s: None)


def test_unreachable_server_is_a_data_error(tmp_path, hub, no_backoff):
    url = hub.url
    hub.close()
    with pytest.raises(DataError, match="cannot download .*refused"):
        download_fineweb(1, tmp_path / "fw", repo_id=REPO, endpoint=url, log=lambda s: None)


def test_refuses_folder_with_other_data(tmp_path, hub):
    out = tmp_path / "d"
    out.mkdir()
    (out / "meta.json").write_text('{"source": "wiki-vital"}')
    with pytest.raises(DataError, match="other prepared data"):
        download_fineweb(1, out, repo_id=REPO, endpoint=hub.url, log=lambda s: None)
