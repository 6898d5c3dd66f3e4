"""`hf:OWNER/NAME[:CONFIG][@SPLIT]` through huggingface_hub against a local stand-in Hub server (no
network): files found from the dataset card's `configs` or the parquet conversion, streamed a file at
a time, giving exactly the shards of the same files prepared locally; failures are one clear line."""

import hashlib
import json
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speedrun.cli import main
from speedrun.config.data import HubSource, parse_hf_source
from speedrun.data import pipeline
from speedrun.data.hub import glob_to_regex
from speedrun.data.meta import load_meta
from speedrun.data.prepare import prepare
from speedrun.data.sources import iter_documents
from speedrun.errors import ConfigError, DataError
from tests.local_server import LocalServer, QuietHandler
from tests.unit.test_prepare import make_docs

SHA = "0123456789abcdef0123456789abcdef01234567"
CONVERTED_SHA = "89abcdef0123456789abcdef0123456789abcdef"
CONVERTED = "refs%2Fconvert%2Fparquet"


class StandInHub:
    """Serves dataset info (`/api/datasets/<repo>[/revision/<rev>]`) and files
    (`/datasets/<repo>/resolve/<rev>/<path>`) for `repos`: repo -> {"files", "card", "converted"}."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(QuietHandler):
            def _send(self, code: int, data: bytes, error: str = "", commit: str = SHA, body: bool = True):
                self.send_response(code)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                if error:
                    self.send_header("X-Error-Code", error)
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _info(self, rest: str) -> None:
                repo, _, rev = rest.partition("/revision/")
                entry = hub.repos.get(repo)
                if entry is None:
                    return self._send(404, b"{}", "RepoNotFound")
                if rev == CONVERTED:
                    if entry.get("converted") is None:
                        return self._send(404, b"{}", "RevisionNotFound")
                    files, sha, card = entry["converted"], CONVERTED_SHA, None
                else:
                    files, sha, card = entry["files"], SHA, entry.get("card")
                info = {"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]}
                if card is not None:
                    info["cardData"] = card
                self._send(200, json.dumps(info).encode(), commit=sha)

            def _file(self, rest: str, body: bool) -> None:
                owner, name, _, rev, path = rest.split("/", 4)
                entry = hub.repos.get(f"{owner}/{name}", {})
                files = entry.get("converted") if rev == CONVERTED_SHA else entry.get("files")
                data = (files or {}).get(unquote(path))
                if data is None:
                    return self._send(404, b"", "EntryNotFound", body=body)
                self._send(200, data, commit=rev, body=body)

            def respond(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                hub.requests.append((self.command, path))
                if path.startswith("/api/datasets/"):
                    self._info(path[len("/api/datasets/") :])
                elif path.startswith("/datasets/"):
                    self._file(path[len("/datasets/") :], body)
                else:
                    self._send(404, b"")

        self.http = LocalServer(Handler)
        self.url = self.http.url

    def close(self):
        self.http.close()


def parquet_bytes(docs, path: Path, **columns) -> bytes:
    pq.write_table(pa.table(columns or {"text": docs}), path, row_group_size=8)
    return path.read_bytes()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    hub = StandInHub()
    local = tmp_path / "local"
    (local / "sample").mkdir(parents=True)
    docs = make_docs(160, seed=3)
    edu = {
        "sample/10BT/000_00000.parquet": parquet_bytes(docs[:60], local / "sample" / "000_00000.parquet"),
        "sample/10BT/001_00000.parquet": parquet_bytes(docs[60:100], local / "sample" / "001_00000.parquet"),
        "data/CC-1/a.parquet": parquet_bytes(docs[100:130], local / "a.parquet"),
        "data/CC-2/b.parquet": parquet_bytes(docs[130:], local / "b.parquet"),
        "README.md": b"---\n---\n",
        "sample/10BT/notes.md": b"not data",
    }
    card = {
        "license": "odc-by",
        "configs": [
            {"config_name": "default", "data_files": [{"split": "train", "path": "data/*/*"}]},
            {"config_name": "sample-10BT", "data_files": [{"split": "train", "path": "sample/10BT/*"}]},
        ],
    }
    hub.repos["someone/edu"] = {"files": edu, "card": card}
    hub.repos["someone/plain"] = {
        "files": {"README.md": b"# no card metadata\n"},
        "card": {"license": "mit"},
        "converted": {
            "default/partial-train/0000.parquet": edu["data/CC-1/a.parquet"],
            "default/partial-train/0001.parquet": edu["data/CC-2/b.parquet"],
            "default/test/0000.parquet": edu["sample/10BT/001_00000.parquet"],
        },
    }
    hub.docs = docs
    hub.local = local
    yield hub
    hub.close()


def run(source, out, hub, **kw):
    return prepare(source, data_dir=out, log=lambda s: None, progress=False, hf_endpoint=hub.url, **kw)


def test_card_config_gives_the_shards_of_the_same_files_prepared_locally(tmp_path, hub):
    out = run("hf:someone/edu:sample-10BT", tmp_path / "hub", hub, workers=1, shard_tokens=700)
    local = run(f"text:{hub.local / 'sample'}", tmp_path / "loc", hub, workers=1, shard_tokens=700)
    meta, ref = load_meta(out), load_meta(local)
    assert meta["source"] == "hf:someone/edu:sample-10BT" and out.name == "hub"
    for split in ("train", "val"):
        names = meta["splits"][split]["shards"]
        assert names[0] == f"hf-someone-edu-sample-10BT_{split}_000000.bin"
        assert [(out / n).read_bytes() for n in names] == [
            (local / n).read_bytes() for n in ref["splits"][split]["shards"]
        ]
        assert meta["splits"][split]["documents"] == ref["splits"][split]["documents"]
    assert list(iter_documents("hf:someone/edu", hub.url)) == hub.docs[100:]  # default config
    assert list(iter_documents("hf:someone/edu:default@train", hub.url)) == hub.docs[100:]
    # pinned to the listed commit
    assert all(SHA in p for m, p in hub.requests if p.startswith("/datasets/"))


def test_max_tokens_downloads_only_the_files_it_reads(tmp_path, hub, monkeypatch):
    monkeypatch.setattr(pipeline, "BATCH_DOCS", 4)  # read-ahead: one split block + a batch, < one file
    run("hf:someone/edu:sample-10BT", tmp_path / "cut", hub, workers=1, max_tokens=600)
    fetched = {p.rsplit("/", 1)[-1] for m, p in hub.requests if m == "GET" and p.startswith("/datasets/")}
    assert fetched == {"000_00000.parquet"}


def test_parquet_conversion_when_the_card_has_no_configs(hub):
    assert list(iter_documents("hf:someone/plain", hub.url)) == hub.docs[100:]
    assert list(iter_documents("hf:someone/plain:default@test", hub.url)) == hub.docs[60:100]


@pytest.mark.parametrize(
    "source, message",
    [
        ("hf:someone/missing", "dataset someone/missing not found on http"),
        ("hf:someone/edu:nope", "dataset someone/edu has no config 'nope'; available: default, sample-10BT"),
        ("hf:someone/edu:sample-10BT@validation", "has no split 'validation'; available: train"),
        ("hf:someone/plain:other", "has no config 'other'; available: default"),
        ("hf:someone/plain@validation", "has no split 'validation'; available: test, train"),
        ("hf:someone/bare", "declares no configs and it has no parquet conversion"),
        ("hf:someone/broken", "unreadable parquet file"),
        ("hf:someone/notext", 'no "text" column (columns: body)'),
    ],
)
def test_hub_errors_are_data_errors(tmp_path, hub, source, message):
    hub.repos["someone/bare"] = {"files": {"x.parquet": b""}, "card": None}
    card = {"configs": [{"config_name": "default", "data_files": "*.parquet"}]}
    hub.repos["someone/broken"] = {"files": {"x.parquet": b"PAR1 not really"}, "card": card}
    body = parquet_bytes(None, tmp_path / "nt.parquet", body=["x", "y"])
    hub.repos["someone/notext"] = {"files": {"x.parquet": body}, "card": card}
    with pytest.raises(DataError, match=None) as err:
        run(source, tmp_path / "out", hub, workers=1)
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


def test_unreachable_hub_is_a_data_error(tmp_path, hub):
    url = hub.url
    hub.close()
    with pytest.raises(DataError, match="cannot list the files of dataset someone/edu .*ConnectError"):
        list(iter_documents("hf:someone/edu", url))


def test_cli_one_line_and_exit_codes(tmp_path, hub, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "hf:someone/edu:sample-10BT", "--workers", "1", "--max-tokens", "3000"]) == 0
    assert load_meta(Path("data/hf-someone-edu-sample-10BT"))["max_tokens"] == 3000
    capsys.readouterr()
    for argv, code, fragment in [
        (["hf:someone/missing"], 1, "not found"),
        (["hf:someone/edu:nope"], 1, "has no config 'nope'"),
        (["hf:someone"], 2, "expected hf:OWNER/NAME"),
        (["hf:someone/edu", "--tokenizer", "bpe:2"], 2, "bpe:2"),
    ]:
        assert main(["prepare", *argv]) == code
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("speedrun: error:") and fragment in err[0], err


def test_parse_and_glob():
    assert parse_hf_source("hf:HuggingFaceFW/fineweb-edu:sample-10BT") == HubSource(
        "HuggingFaceFW/fineweb-edu", "sample-10BT", "train"
    )
    assert parse_hf_source("hf:a/b@test") == HubSource("a/b", None, "test")
    for bad in ("hf:", "hf:a", "hf:a/b:", "hf:a/b@", "hf:a/b c"):
        with pytest.raises(ConfigError):
            parse_hf_source(bad)
    assert glob_to_regex("data/*/*").fullmatch("data/CC-1/a.parquet")
    assert not glob_to_regex("data/*").fullmatch("data/CC-1/a.parquet")
    assert glob_to_regex("data/**").fullmatch("data/CC-1/a.parquet")
    assert glob_to_regex("**/train-*.parquet").fullmatch("train-0.parquet")
    assert glob_to_regex("**/train-*.parquet").fullmatch("x/y/train-0.parquet")
    assert glob_to_regex("sample/10BT/0[0-9]?_*").fullmatch("sample/10BT/001_00000.parquet")
