"""`speedrun prepare`: text source -> tokenizer -> `.bin` shards + `meta.json`, reproducibly, at any scale.
Documents stream through a seeded by-document split and ordered tokenizer workers (`pipeline.py`), so the
same source, seed and tokenizer give byte-identical shards for any number of workers. The folder is built
under a hidden temporary name and renamed into place, `meta.json` last: a target with a `meta.json` is
always complete."""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from speedrun.atomic import TEMP_NAME_EXTRA, check_name_fits, user_folder
from speedrun.config.data import FINEWEB, parse_bpe_size, parse_fineweb_source
from speedrun.data.folder_lock import replacing
from speedrun.data.meta import META_FILE, default_data_dir, foreign_entries, write_meta
from speedrun.data.pipeline import (
    SplitWriter,
    assign_splits,
    batches,
    default_workers,
    encode_batches,
    split_plan,
    stop_signals_interrupt,
)
from speedrun.data.sources import (
    iter_documents,
    source_size,
    source_slug,
)
from speedrun.data.tokenizers import (
    Tokenizer,
    gpt2_tokenizer,
    save_tokenizer,
    train_bpe_tokenizer,
)
from speedrun.errors import ConfigError, DataError

BPE_SAMPLE_BYTES = 100_000_000  # bpe:N is trained on the first this many bytes of train-split text


def _check_tokenizer_name(tokenizer: str) -> None:
    if tokenizer != "gpt2":
        parse_bpe_size(tokenizer)  # ConfigError for anything that is not bpe:N with a sane N


def _check_target(data_dir: Path) -> None:
    """Refuse to replace a folder that is not wholly ours: it may hold the user's files. Checked
    before any work, with what `_install` needs: a mount point cannot be renamed into place."""
    if not data_dir.exists():
        return
    if os.path.ismount(data_dir):
        raise DataError(
            f"{data_dir}: is a mount point, which prepare cannot replace (it builds beside the folder "
            f"and renames it into place); use a folder inside it, e.g. --data-dir {data_dir / 'data'}"
        )
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: exists and is a file, not a data folder; not replacing it")
    foreign = foreign_entries(data_dir)
    if foreign and not (data_dir / META_FILE).is_file():
        raise DataError(
            f"{data_dir}: exists and is not a prepared data folder (no {META_FILE}); not replacing it"
        )
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise DataError(
            f"{data_dir}: holds files that are not prepared data of speedrun ({shown}); not replacing it "
            "(move them away, or choose another --data-dir)"
        )
    with replacing(data_dir):  # a run training from it: refused now, before any work
        pass


#: the process id of the prepare building a temporary folder, inside it until it is renamed into place
OWNER = ".prepare-pid"


def _left_behind(data_dir: Path, log: Callable[..., object]) -> None:
    """The temporary folders of earlier prepares into `data_dir`: one whose prepare was killed (its process
    is gone) is removed, with a line saying so; one whose prepare still runs is refused (two prepares into one
    folder); one from before OWNER is named, not touched (issue 46: nothing mentioned them)."""
    for tmp in sorted(data_dir.parent.glob(f".{glob.escape(data_dir.name)}.tmp-*")):
        try:
            pid = int((tmp / OWNER).read_text())
        except (OSError, ValueError):
            log(f"note: {tmp} is a temporary folder of an earlier prepare (remove it if none runs)")
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"removed {tmp}, the temporary folder of a prepare that was killed (process {pid})")
            continue
        except PermissionError:
            pass  # alive, another user's
        if pid != os.getpid():
            raise DataError(
                f"another prepare (process {pid}) is writing {data_dir} now ({tmp}); wait for it to end, "
                "or choose another --data-dir"
            )


def _install(tmp: Path, data_dir: Path) -> None:
    """Move the finished folder into place, replacing an earlier prepared folder of the same name."""
    _check_target(data_dir)
    old = None
    with replacing(data_dir):  # and again while renaming: a run may have started since
        if data_dir.exists():
            old = Path(tempfile.mkdtemp(dir=data_dir.parent, prefix=f".{data_dir.name}.old-"))
            os.replace(data_dir, old / "x")
        try:
            os.replace(tmp, data_dir)
        except BaseException:
            if old is not None:  # put the earlier folder back rather than leave nothing
                os.replace(old / "x", data_dir)
                old.rmdir()
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _bar(desc: str, total: int | None, show: bool) -> tqdm:
    """Text bytes on a tqdm bar (so the rate reads MB/s); silent unless `show`."""
    return tqdm(desc=desc, total=total, unit="B", unit_scale=True, disable=not show, dynamic_ncols=True)


def bpe_sample(
    docs: Iterable[str], val_fraction: float, seed: int, limit: int, show: bool = False
) -> Iterator[str]:
    """The BPE training sample: train-split documents in source order until `limit` UTF-8 bytes
    are reached (the document that crosses it included). Streamed into rustbpe, never held."""
    taken = 0
    with _bar("bpe sample", limit, show) as bar:
        for doc, is_val in assign_splits(docs, val_fraction, seed):
            if taken >= limit:
                return
            if not is_val:
                n = len(doc.encode("utf-8"))
                taken += n
                bar.update(n)
                yield doc


def check_options(workers: int | None, max_tokens: int | None, shard_tokens: int) -> int:
    """Validate the run options (ConfigError); the worker count to use."""
    assert shard_tokens >= 1, shard_tokens  # no command-line option sets it
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"--max-tokens must be a positive number of tokens, got {max_tokens}")
    if workers is None:
        return default_workers()
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    return min(workers, default_workers())  # more processes than cores only cost memory


def prepare(
    source: str,
    tokenizer: str = "gpt2",
    data_dir: Path | None = None,
    val_fraction: float = 0.05,
    seed: int = 1337,
    shard_tokens: int = 100_000_000,
    log: Callable[[str], object] = print,
    workers: int | None = None,
    max_tokens: int | None = None,
    bpe_sample_bytes: int = BPE_SAMPLE_BYTES,
    hf_endpoint: str | None = None,
    progress: bool | None = None,
) -> Path:
    """Build `data_dir` (default `default_data_dir(source, tokenizer)`) and return it. `max_tokens` stops
    after the document that reaches it (both splits); `progress` defaults to stderr being a terminal."""
    n_fineweb = parse_fineweb_source(source)
    if n_fineweb is not None:
        if tokenizer != "gpt2":
            raise ConfigError(f"source {source!r} is pre-tokenized with gpt2; got tokenizer {tokenizer!r}")
        assert max_tokens is None, "cli refuses --max-tokens for fineweb10B (PREPARE_OPTIONS)"
        from speedrun.data.fineweb import download_fineweb

        return download_fineweb(n_fineweb, Path(data_dir) if data_dir else Path("data") / FINEWEB, log=log)
    _check_tokenizer_name(tokenizer)
    check_options(workers, max_tokens, shard_tokens)
    split_plan(val_fraction)
    first = iter_documents(source, hf_endpoint)  # unknown source, missing path: fail before any work
    opened = [first]

    def documents() -> Iterator[str]:
        return opened.pop() if opened else iter_documents(source, hf_endpoint)

    data_dir = Path(data_dir) if data_dir is not None else default_data_dir(source, tokenizer)
    return prepare_documents(
        documents, data_dir, source, tokenizer, val_fraction, seed, shard_tokens, log, workers, max_tokens,
        bpe_sample_bytes, progress, total_bytes=source_size(source),
    )  # fmt: skip


@stop_signals_interrupt()
def prepare_documents(
    documents: Callable[[], Iterable[str]],
    data_dir: Path,
    source: str,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.05,
    seed: int = 1337,
    shard_tokens: int = 100_000_000,
    log: Callable[[str], object] = print,
    workers: int | None = None,
    max_tokens: int | None = None,
    bpe_sample_bytes: int = BPE_SAMPLE_BYTES,
    progress: bool | None = None,
    total_bytes: int | None = None,
) -> Path:
    """`prepare` for any document stream: `documents()` returns a fresh iterator over the corpus
    each time it is called (twice for bpe:N: once for the training sample, once to tokenize)."""
    _check_tokenizer_name(tokenizer)
    n_workers = check_options(workers, max_tokens, shard_tokens)
    m, block = split_plan(val_fraction)
    show = sys.stderr.isatty() if progress is None else progress
    check_name_fits(data_dir, "--data-dir", TEMP_NAME_EXTRA)  # it is built as .NAME.tmp-XXXXXXXX
    data_dir = user_folder(data_dir)  # a link to a folder (a big disk) is filled there, and kept
    _check_target(data_dir)
    log(f"prepare {source}: tokenizer {tokenizer}, {n_workers} worker(s)")

    data_dir.parent.mkdir(parents=True, exist_ok=True)
    _left_behind(data_dir, log)
    tmp = Path(tempfile.mkdtemp(dir=data_dir.parent, prefix=f".{data_dir.name}.tmp-"))
    (tmp / OWNER).write_text(str(os.getpid()))
    slug = source_slug(source)
    writers = {s: SplitWriter(tmp, slug, s, shard_tokens) for s in ("val", "train")}
    try:
        tmp.chmod(0o755)  # mkdtemp makes a private folder; the result is ordinary shared data
        if tokenizer == "gpt2":
            tok = gpt2_tokenizer()
        else:
            sample = bpe_sample(documents(), val_fraction, seed, bpe_sample_bytes, show)
            tok = train_bpe_tokenizer(sample, parse_bpe_size(tokenizer))
            save_tokenizer(tok, tmp)
        _write_splits(documents(), tok, writers, val_fraction, seed, n_workers, max_tokens, show, total_bytes)
        stats = {s: w.close() for s, w in writers.items()}
        if max_tokens is not None and not (stats["val"]["documents"] and stats["train"]["documents"]):
            n = stats["val"]["documents"] + stats["train"]["documents"]
            raise DataError(
                f"--max-tokens {max_tokens} stops after {n} document(s), too few for a train/val split "
                f"(val takes {m} of every {block}); raise --max-tokens"
            )
        write_meta(
            tmp, source, tok, stats, seed=seed, val_fraction=val_fraction, split_block=[m, block],
            max_tokens=max_tokens, bpe_sample_bytes=None if tokenizer == "gpt2" else bpe_sample_bytes,
        )  # fmt: skip
        (tmp / OWNER).unlink()
        _install(tmp, data_dir)
    except BaseException as e:
        for w in writers.values():
            w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.filename is None:  # a full disk inside a writer: name the target
            raise OSError(e.errno, e.strerror, str(data_dir)) from None
        raise
    for s in ("train", "val"):
        log(
            f"  {s}: {stats[s]['tokens']:,} tokens, {stats[s]['documents']:,} documents, "
            f"{len(stats[s]['shards'])} shard(s)"
        )
    log(f"wrote {data_dir}")
    return data_dir


def _write_splits(
    docs: Iterable[str],
    tok: Tokenizer,
    writers: dict[str, SplitWriter],
    val_fraction: float,
    seed: int,
    workers: int,
    max_tokens: int | None,
    show: bool,
    total_bytes: int | None,
) -> None:
    """Split, tokenize (in order, on `workers` processes) and write; stop at `max_tokens`."""
    stream = encode_batches(batches(assign_splits(docs, val_fraction, seed)), tok, workers)
    total = n_docs = 0
    with _bar("prepare", total_bytes, show) as bar:
        try:
            for is_val, tokens, lengths, n_bytes in stream:
                flags = np.asarray(is_val, dtype=bool)
                stop = max_tokens is not None and total + tokens.size >= max_tokens
                if stop:  # keep documents up to the one at which the running count reaches max_tokens
                    k = int(np.searchsorted(total + np.cumsum(lengths), max_tokens)) + 1
                    tokens, lengths = tokens[: lengths[:k].sum()], lengths[:k]
                    n_bytes, flags = n_bytes[:k], flags[:k]
                token_is_val = np.repeat(flags, lengths)
                for split, mask, token_mask in (("val", flags, token_is_val), ("train", ~flags, None)):
                    if mask.any():
                        part = (
                            tokens
                            if mask.all()
                            else tokens[~token_is_val if token_mask is None else token_mask]
                        )
                        writers[split].write(part, int(mask.sum()), int(n_bytes[mask].sum()))
                total += tokens.size
                n_docs += flags.size
                bar.update(int(n_bytes.sum()))
                bar.set_postfix_str(f"{n_docs:,} docs, {total:,} tokens", refresh=False)
                if stop:
                    break
        finally:
            stream.close()  # stops the worker pool, also on errors and interrupts
        if bar.total is not None:
            bar.total = bar.n  # the size was an estimate (file sizes); end the bar at 100%
            bar.refresh()
