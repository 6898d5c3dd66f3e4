"""`speedrun eval`: validation loss and bits per byte of a saved model on any prepared shard folder,
read exactly as training's validation reads it (`val_batches`), so a run's final checkpoint on its own
data reproduces its final val loss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from speedrun.config import Config
from speedrun.data.meta import check_fits, load_meta, shard_paths
from speedrun.errors import ConfigError
from speedrun.tools.runs import run_tokenizer
from speedrun.train.distributed import DistContext
from speedrun.train.evaluate import evaluate


def eval_token_count(cfg: Config, available: int, tokens: int | None) -> tuple[int, int]:
    """(tokens, micro-batch tokens): `tokens`, or the run's val_tokens capped at what the folder holds,
    in whole sequences; the run's micro-batch when it divides the count, else one sequence per batch."""
    seq = cfg.train.val_seq_len or cfg.train.seq_len  # the rows validation reads
    if tokens is None:
        tokens = min(cfg.train.val_tokens, (available - 1) // seq * seq)
    if tokens < seq or tokens % seq:
        raise ConfigError(f"--tokens {tokens} must be a positive multiple of the run's seq_len ({seq})")
    micro = cfg.train.val_seq_len or cfg.train.micro_batch_tokens
    return tokens, micro if tokens % micro == 0 else seq


def evaluate_loss(
    model: torch.nn.Module,
    cfg: Config,
    data_dir: Path,
    tokens: int | None = None,
    device: torch.device | str = "cpu",
    checkpoint: Path | None = None,
) -> dict:
    """{'val_loss', 'val_bpb', 'tokens', 'data'} of `model` (as load_model built it) on `data_dir`'s val
    split, whose tokenizer must be the run's (name, vocabulary size and hash)."""
    device = torch.device(device)
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    check_fits(meta, cfg, data_dir)
    tokenizer = run_tokenizer(cfg, data_dir, checkpoint)
    n, micro = eval_token_count(cfg, meta["splits"]["val"]["tokens"], tokens)
    token_bytes = torch.from_numpy(np.asarray(tokenizer.token_byte_lengths(), dtype=np.int64)).to(device)
    one_process = DistContext(rank=0, local_rank=0, world_size=1, device=device)
    val_files = shard_paths(data_dir, "val", meta)
    loss, bpb = evaluate(model, cfg, val_files, micro, token_bytes, one_process, tokens=n)
    return {"val_loss": loss, "val_bpb": bpb, "tokens": n, "data": str(data_dir)}
