"""#92's row-sharded n-gram table on the launch's ranks against the whole table on one process (run by
tests/library_checks.py): the same global batches, each rank its share of the rows; a save of the
sharded table and its Adam state resumed on one process."""

from __future__ import annotations

import torch

from speedrun.model.gpt2026.ngram import NgramEmbed, ngram_rows
from speedrun.optim.row_adam import RowAdam
from speedrun.optim.row_shard import RowShard, shard_part

ROWS, DIM, SIGNS, B, T = 96, 8, 16, 4, 12
HYPER = [(0.01 * (1 + s % 3), 0.95 if s < 4 else 0.95**2, 0.5) for s in range(10)]  # lr, β2, wd per step


def _part() -> NgramEmbed:
    torch.manual_seed(0)
    part = NgramEmbed(ROWS, DIM, 1, SIGNS, dtype=torch.float64)
    with torch.no_grad():
        part.table.normal_()
    return part


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 300, (B, T), generator=gen)
    return idx, torch.randn(B, T, DIM, generator=gen, dtype=torch.float64)


def _train(part: NgramEmbed, shard: RowShard, adam: RowAdam, steps: range, rank: int, world: int) -> None:
    """Each step: this rank's rows of the global batch, the mean loss over them; pull, forward, push, Adam."""
    per = B // world
    for s in steps:
        idx, w = _batch(s)
        idx, w = idx[rank * per : (rank + 1) * per], w[rank * per : (rank + 1) * per]
        part.pulled = shard.pull(ngram_rows(idx, ROWS))
        (part(idx) * w).sum().div(per).backward()
        rows, grad = shard.push(part.pulled)
        adam.step(rows, grad, *HYPER[s])
    part.pulled = None


def sharded_equals_single(rank: int, world: int) -> dict[str, float]:
    """Max |sharded − single| of the table after 6 steps, and after a 2-process save resumed on one
    process for 4 more steps."""
    part = _part()
    shard = shard_part(part)
    adam = RowAdam(shard.shard, beta1=0.0, eps=1e-8, row_moment=True)
    _train(part, shard, adam, range(6), rank, world)
    saved = shard.full_state(adam.state_dict())  # rank 0 only
    if rank != 0:
        return {}
    single = _part()
    one = shard_part(single, local=True)
    one_adam = RowAdam(one.shard, beta1=0.0, eps=1e-8, row_moment=True)
    _train(single, one, one_adam, range(6), 0, 1)
    out = {"max_abs_diff": (saved["table"] - one.shard).abs().max().item()}
    resumed = _part()
    again = shard_part(resumed, local=True)
    again_adam = RowAdam(again.shard, beta1=0.0, eps=1e-8, row_moment=True)
    again_adam.load_state_dict(again.load_full_state(saved))
    _train(resumed, again, again_adam, range(6, 10), 0, 1)
    _train(single, one, one_adam, range(6, 10), 0, 1)
    out["resumed_diff"] = (again.shard - one.shard).abs().max().item()
    out["moved"] = (one.shard - _part().table).abs().max().item()
    return out
