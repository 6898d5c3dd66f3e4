"""What the training loop needs of the data, checked before step 0: the shard folder (prepared on
first use for bundled sources), its agreement with the recipe, this world size's micro-batch, every
validation token read once, the tokenizer and the bytes per token for bits per byte."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speedrun.config import Config
from speedrun.config.stages import stage_plan
from speedrun.data.bos_loader import DocumentLoader
from speedrun.data.folder_lock import hold_for_training
from speedrun.data.loader import TokenLoader, val_batches
from speedrun.data.meta import (
    DATA_FINGERPRINT,
    META_FILE,
    check_fits,
    data_dir_for,
    load_meta,
    meta_fingerprint,
    shard_paths,
    tokenizer_for_data,
)
from speedrun.data.prepare import prepare
from speedrun.data.tokenizers import Tokenizer
from speedrun.errors import ConfigError, DataError
from speedrun.train import distributed
from speedrun.train.run.rundir import RunDir
from speedrun.train.stages import stage_values

AUTO_PREPARED_SOURCES = ("wiki-vital",)  # bundled offline, so `speedrun train` can prepare it itself


def ensure_data(
    cfg: Config,
    ctx: distributed.DistContext,
    log=print,
    hold: Callable[[int | None], None] = lambda fd: None,
    trained_on: tuple[str, str] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The shard folder and its meta.json, preparing bundled sources when missing; `hold` keeps the folder's
    shared lock (data/folder_lock.py), so `prepare` cannot replace it while the run trains from it. A resumed
    run passes `trained_on`, the (folder, fingerprint) its last start trained on: the folder must hold that
    data (any folder may: data.dir can change on a resume), and nothing is prepared behind its back."""
    data_dir = data_dir_for(cfg)
    default_dir = not cfg.data.dir  # an explicit data.dir is never filled behind the user's back
    missing = not (data_dir / META_FILE).exists()
    if missing and trained_on is not None:
        folder, fingerprint = trained_on
        raise DataError(
            f"{data_dir} (from {Path.cwd()}) holds no prepared data; this run trained on {folder} "
            f"({DATA_FINGERPRINT}{fingerprint}): resume from the folder the run started in, or add "
            "data.dir=FOLDER holding that data"
        )
    if default_dir and missing and cfg.data.source in AUTO_PREPARED_SOURCES:
        if ctx.is_main:
            log(f"data: {data_dir} missing, preparing {cfg.data.source} with tokenizer {cfg.data.tokenizer}")
            prepare(cfg.data.source, cfg.data.tokenizer, data_dir, log=log)
        if ctx.distributed:
            torch.distributed.barrier()
    hold(hold_for_training(data_dir))
    meta = load_meta(data_dir)
    if trained_on is not None and meta_fingerprint(meta) != trained_on[1]:
        raise DataError(
            f"{data_dir} holds other data than this run trained on ({DATA_FINGERPRINT}"
            f"{meta_fingerprint(meta)}, the run's {trained_on[1]} in {trained_on[0]}); give data.dir=FOLDER "
            "holding the run's data"
        )
    check_fits(meta, cfg, data_dir)
    return data_dir, meta


_DATA_LINE = re.compile(r"^data: (.+) \([^()]*" + re.escape(DATA_FINGERPRINT) + r"([0-9a-f]+)\)\s*$")


def trained_data(run_path: Path) -> tuple[str, str] | None:
    """(folder, fingerprint) of the data the run's latest start trained on, from its log.txt `data:` line
    (None: a new run, or one from before the fingerprint)."""
    try:
        lines = (run_path / "log.txt").read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [m.groups() for m in map(_DATA_LINE.match, lines) if m]
    return found[-1] if found else None


def micro_batch_tokens(cfg: Config, world_size: int) -> int:
    """Tokens per process per forward, the one owner of the batch rule: the recipe's value when it divides
    the global batch and val tokens over `world_size`, else the largest smaller whole number of sequences
    that does (so `torchrun --nproc_per_node=N` needs no overrides; every step's tokens stay the same)."""
    t = cfg.train
    chunks = t.document_rows
    if cfg.data.loader == "documents" and chunks % world_size:
        raise ConfigError(
            f"data.loader=documents: the {chunks} rows of a step (train.global_batch_tokens / "
            f"train.micro_batch_tokens) cannot be split over {world_size} processes"
        )
    # validation reads micro-batches of this size only without its own row (train.val_seq_len: the
    # 2025-26 records validate 262,144-token rows, and 10,485,760 is no multiple of their 49,152)
    val_tokens = 0 if t.val_seq_len else t.val_tokens
    per_round = world_size * t.micro_batch_tokens
    if t.global_batch_tokens % per_round == 0 and val_tokens % per_round == 0:
        return t.micro_batch_tokens
    sequences = t.global_batch_tokens // t.seq_len
    for per_micro in range(t.micro_batch_tokens // t.seq_len, 0, -1):
        if sequences % (world_size * per_micro) == 0 and t.global_batch_tokens % t.seq_len == 0:
            micro = per_micro * t.seq_len
            if val_tokens % (world_size * micro) == 0:
                return micro
    raise ConfigError(
        f"train.global_batch_tokens ({t.global_batch_tokens}) cannot be split over {world_size} processes "
        f"in whole sequences of train.seq_len ({t.seq_len}) that also divide train.val_tokens "
        f"({t.val_tokens}); choose a global batch and val_tokens that are multiples of "
        f"{world_size} x {t.seq_len}"
    )


def val_micro_batch_tokens(cfg: Config, world_size: int, micro: int) -> int:
    """Tokens per process per validation forward: one `train.val_seq_len` row when set, else `micro`."""
    t = cfg.train
    if not t.val_seq_len:
        return micro
    if t.val_tokens % (world_size * t.val_seq_len):
        raise ConfigError(
            f"train.val_tokens ({t.val_tokens}) is not a multiple of {world_size} processes x "
            f"train.val_seq_len ({t.val_seq_len})"
        )
    return t.val_seq_len


@dataclass
class RunData:
    """What the loop needs of the data: shards, this world's micro-batch, tokenizer, bytes per token."""

    train_files: list[Path]
    val_files: list[Path]
    micro_batch_tokens: int
    tokenizer: Tokenizer
    token_bytes: torch.Tensor  # (vocab,) on the device, for bits per byte
    eot_id: int
    val_micro_batch_tokens: int = 0  # tokens per process per validation forward
    source: str | None = None  # meta.json's source: what the shards hold (data.source may be a label)


def load_data(cfg: Config, ctx: distributed.DistContext, run: RunDir) -> RunData:
    """Find (or prepare) the shards, check them against the recipe and read all validation tokens
    once, so that any problem with the data surfaces before step 0."""
    trained_on = trained_data(run.path) if run.resumed else None
    data_dir, meta = ensure_data(cfg, ctx, log=run.log, hold=run.keep, trained_on=trained_on)
    # the shards meta.json lists, not a glob: a stray *_train_*.bin copied into the folder is not trained on
    train_files, val_files = shard_paths(data_dir, "train", meta), shard_paths(data_dir, "val", meta)
    micro = micro_batch_tokens(cfg, ctx.world_size)
    val_micro = val_micro_batch_tokens(cfg, ctx.world_size, micro)
    row = cfg.train.val_seq_len or cfg.train.seq_len
    for _ in val_batches(
        val_files, cfg.train.val_tokens, val_micro, row, ctx.rank, ctx.world_size,
        vocab_size=cfg.model.vocab_size,
    ):  # fmt: skip
        pass  # every validation token read once: short or damaged val data fails now, not after training
    tokenizer = tokenizer_for_data(data_dir, meta)
    token_bytes = torch.from_numpy(np.asarray(tokenizer.token_byte_lengths(), dtype=np.int64))
    run.log(
        f"data: {data_dir.resolve()} ({meta['tokenizer']}, vocab {meta['vocab_size']}, "
        f"{meta['splits']['train']['tokens']:,} train / {meta['splits']['val']['tokens']:,} val tokens, "
        f"{DATA_FINGERPRINT}{meta_fingerprint(meta)})"
    )
    return RunData(
        train_files, val_files, micro, tokenizer, token_bytes.to(ctx.device), meta["eot_id"], val_micro,
        meta.get("source"),
    )  # fmt: skip


def open_loader(cfg: Config, data: RunData, ctx: distributed.DistContext) -> TokenLoader | DocumentLoader:
    """This rank's share of every step's batch, prefetched on a background thread (close it)."""
    t, d = cfg.train, cfg.data
    if d.loader == "documents":
        plan = stage_plan(cfg)

        def stage_of(step: int) -> tuple[int, int, int]:
            if plan is None:
                return t.global_batch_tokens, d.max_doc_len, 0
            v = stage_values(step, plan)
            return v.batch_tokens, v.max_doc_len, v.segment  # #92: attention segments in the loader

        return DocumentLoader(
            data.train_files, t.document_rows, stage_of,
            data.eot_id, ctx.rank, ctx.world_size, rule=d.doc_rule, max_docs=d.max_docs,
            vocab_size=cfg.model.vocab_size, device=ctx.device,
            with_cu_seqlens=cfg.model.attention == "varlen",
        )  # fmt: skip
    return TokenLoader(
        data.train_files, t.global_batch_tokens, data.micro_batch_tokens, t.seq_len, ctx.rank,
        ctx.world_size, align_to_bos=cfg.data.align_to_bos, bos_id=data.eot_id,
        vocab_size=cfg.model.vocab_size, device=ctx.device, rank_cursors=cfg.data.rank_cursors,
        end_margin=cfg.data.end_margin, repeat_first_batch=cfg.data.repeat_first_batch,
    )  # fmt: skip
