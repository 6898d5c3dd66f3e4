"""`hf:OWNER/NAME[:CONFIG][@SPLIT]`: stream a text dataset from the Hugging Face Hub, file by file.
A split's files are found as the `datasets` library finds them, without it: the dataset card's
`configs:` globs, else the Hub's `refs/convert/parquet` branch. Files are downloaded one at a time into
the Hugging Face cache (an interrupted prepare resumes), pinned to the listing's commit."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from speedrun.config.data import HubSource
from speedrun.data.sources import TEXT_SUFFIXES, iter_file
from speedrun.errors import DataError, first_line

CONVERTED_REVISION = "refs/convert/parquet"
T = TypeVar("T")


def _where(endpoint: str | None) -> str:
    return endpoint or "the Hugging Face Hub"


def hub_call(what: str, repo_id: str, endpoint: str | None, fn: Callable[[], T]) -> T:
    """Run a huggingface_hub call; every failure becomes one DataError line naming what failed."""
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        return fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except RepositoryNotFoundError:
        raise DataError(
            f"dataset {repo_id} not found on {_where(endpoint)} "
            "(a private or gated dataset needs `hf auth login`)"
        ) from None
    except Exception as e:  # network, HTTP status, disk: all end the same way for the user
        root = e.__cause__ or e
        why = f"{type(root).__name__}: {first_line(root)}"
        raise DataError(f"cannot {what} of dataset {repo_id} on {_where(endpoint)}: {why}") from None


def glob_to_regex(pattern: str) -> re.Pattern:
    """A `data_files` glob as the Hub uses it: `*` and `?` stay within one folder, `**` crosses."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1 :]:
            j = pattern.index("]", i + 1)
            out.append("[" + pattern[i + 1 : j].replace("!", "^", 1) + "]")
            i = j + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def _split_patterns(data_files: object) -> dict[str, list[str]]:
    """Normalize a card's `data_files` (a string, a list of strings, or split/path entries)."""
    if isinstance(data_files, str):
        return {"train": [data_files]}
    if isinstance(data_files, dict):
        return {str(k): [v] if isinstance(v, str) else list(v) for k, v in data_files.items()}
    out: dict[str, list[str]] = {}
    for entry in data_files if isinstance(data_files, list) else []:
        if isinstance(entry, str):
            out.setdefault("train", []).append(entry)
        elif isinstance(entry, dict) and "path" in entry:
            paths = entry["path"]
            out.setdefault(str(entry.get("split", "train")), []).extend(
                [paths] if isinstance(paths, str) else paths
            )
    return out


def _pick(kind: str, wanted: str | None, have: list[str], src: HubSource) -> str:
    if wanted is None:  # the only one there is, else "default"
        wanted = have[0] if len(have) == 1 else "default"
    if wanted not in have:
        owner = f"dataset {src.repo_id}" if kind == "config" else f"config {src.config or 'default'!r}"
        raise DataError(f"{owner} has no {kind} {wanted!r}; available: {', '.join(sorted(have)) or 'none'}")
    return wanted


def _from_card(configs: list, files: list[str], src: HubSource) -> list[str]:
    by_name = {str(c.get("config_name", "default")): c for c in configs if isinstance(c, dict)}
    config = _pick("config", src.config, list(by_name), src)
    splits = _split_patterns(by_name[config].get("data_files"))
    _pick("split", src.split, list(splits), HubSource(src.repo_id, config, src.split))
    regexes = [glob_to_regex(p) for p in splits[src.split]]
    return [f for f in files if any(r.fullmatch(f) for r in regexes)]


def _from_conversion(files: list[str], src: HubSource) -> list[str]:
    parquet = [f for f in files if f.endswith(".parquet") and f.count("/") == 2]
    config = _pick("config", src.config, sorted({f.split("/")[0] for f in parquet}), src)
    in_config = [f.split("/")[1] for f in parquet if f.startswith(config + "/")]
    splits = sorted({s.removeprefix("partial-") for s in in_config})
    _pick("split", src.split, splits, HubSource(src.repo_id, config, src.split))
    folders = (f"{config}/{src.split}/", f"{config}/partial-{src.split}/")
    return [f for f in parquet if f.startswith(folders)]


def hub_files(src: HubSource, endpoint: str | None = None) -> tuple[str, list[str]]:
    """(commit, sorted files) of the config's split: DataError naming what does not exist."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RevisionNotFoundError

    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None  # also when set after import
    api = HfApi(endpoint=endpoint)
    info = hub_call("list the files", src.repo_id, endpoint, lambda: api.dataset_info(src.repo_id))
    configs = info.card_data.to_dict().get("configs") if info.card_data is not None else None
    if configs:
        commit, files = info.sha, _from_card(configs, [s.rfilename for s in info.siblings or []], src)
    else:

        def converted():
            try:
                return api.dataset_info(src.repo_id, revision=CONVERTED_REVISION)
            except RevisionNotFoundError:
                return None

        conv = hub_call("list the parquet conversion", src.repo_id, endpoint, converted)
        if conv is None:
            raise DataError(
                f"dataset {src.repo_id}: its card declares no configs and it has no parquet conversion"
            )
        commit, files = conv.sha, _from_conversion([s.rfilename for s in conv.siblings or []], src)
    files = sorted(f for f in files if f.endswith(TEXT_SUFFIXES))
    if not files:
        raise DataError(
            f"dataset {src.repo_id} config {src.config or 'default'!r} split {src.split!r}: "
            f"no {', '.join(TEXT_SUFFIXES)} files"
        )
    return commit or "main", files


def hub_documents(src: HubSource, endpoint: str | None = None) -> Iterator[str]:
    """Documents of the split, downloading each file only when the previous one is read."""
    from huggingface_hub import hf_hub_download

    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    commit, files = hub_files(src, endpoint)
    for name in files:
        path = hub_call(
            f"download {name}",
            src.repo_id,
            endpoint,
            lambda name=name: hf_hub_download(
                src.repo_id, name, repo_type="dataset", revision=commit, endpoint=endpoint
            ),
        )
        yield from iter_file(Path(path))
