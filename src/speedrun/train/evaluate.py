"""Validation: mean loss and bits per byte over a fixed number of held-out tokens."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from speedrun.config import Config
from speedrun.data.bos_loader import cu_seqlens, record_max_docs
from speedrun.data.loader import val_batches
from speedrun.train import distributed
from speedrun.train.step import autocast, autocast_dtype


def row_cu_seqlens(x: torch.Tensor, cfg: Config) -> torch.Tensor:
    """cu_seqlens of one (1, T) validation row from its BOS tokens, as the records build them for their
    unaligned validation chunks (padded to the records' length for T: one shape for every row)."""
    assert x.size(0) == 1, "varlen validation reads one row per forward (train.val_seq_len)"
    max_docs = record_max_docs(x.size(1))
    cu, _ = cu_seqlens(x[0].cpu().numpy(), cfg.model.eot_id, max_docs)
    return torch.from_numpy(cu).to(x.device)


def write_marks(model: torch.nn.Module) -> list[tuple[int, int, int]]:
    """Per parameter: its version counter and its gradient's identity and version. An optimizer step
    (in place) or a backward pass (a new or accumulated .grad) between two calls changes them."""
    return [(p._version, id(p.grad), -1 if p.grad is None else p.grad._version) for p in model.parameters()]


@contextlib.contextmanager
def audited(model: torch.nn.Module, clock) -> Iterator[None]:
    """Count in `clock.eval_writes` a validation inside this block that wrote a weight or a gradient:
    work outside the clock that `verify` refuses (#205's test-time training at evaluation)."""
    before = write_marks(model)
    yield
    if clock.eval_writes is not None and write_marks(model) != before:
        clock.eval_writes += 1


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    cfg: Config,
    val_files: list[Path],
    micro_batch_tokens: int,
    token_bytes: torch.Tensor | None,
    ctx: distributed.DistContext,
    tokens: int | None = None,
) -> tuple[float, float | None]:
    """Mean val loss over exactly `tokens` (default `train.val_tokens`) tokens split across ranks, and
    bits per byte (None without byte lengths). The same tokens and the same sum for every world size."""
    t = cfg.train
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, tokens, bytes
    model.eval()
    row = t.val_seq_len or t.seq_len
    batches = val_batches(
        val_files, tokens or t.val_tokens, micro_batch_tokens, row, ctx.rank, ctx.world_size,
        vocab_size=cfg.model.vocab_size, device=ctx.device,
    )  # fmt: skip
    dtype = autocast_dtype(cfg) if t.val_autocast else None  # 2024-10 records validate in fp32
    for x, y in batches:
        extra = (row_cu_seqlens(x, cfg),) if cfg.model.attention == "varlen" else ()
        with autocast(ctx.device, dtype):
            losses = model(x, y, *extra, reduction="none")
        totals[0] += losses.double().sum()
        totals[1] += y.numel()
        if token_bytes is not None:
            totals[2] += token_bytes[y].sum()
    model.train()
    loss_sum, tokens, n_bytes = distributed.all_reduce_sum(totals, ctx).tolist()
    bpb = loss_sum / (math.log(2) * n_bytes) if token_bytes is not None and n_bytes > 0 else None
    return loss_sum / tokens, bpb
