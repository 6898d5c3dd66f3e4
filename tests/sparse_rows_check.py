"""#71's sparse bigram-gradient exchange against the dense exchange on the launch's ranks (run by
tests/library_checks.py): each rank's gradient is non-zero on its own random rows only."""

from __future__ import annotations

import torch
import torch.distributed as dist

from speedrun.optim.sparse_rows import sparse_reduce_scatter


def sparse_equals_dense(rank: int, world: int) -> dict[str, float | bool]:
    """Max |sparse − dense| over a few tables, and whether they were equal bit for bit."""
    worst, equal = 0.0, True
    for trial, (n, d, k) in enumerate([(96, 8, 20), (1000, 16, 300), (64, 4, 0), (64, 4, 64)]):
        gen = torch.Generator().manual_seed(100 * trial + rank)
        touched = torch.randperm(n, generator=gen)[:k].sort().values
        grad = torch.zeros(n, d)
        grad[touched] = torch.randn(len(touched), d, generator=gen)
        before = grad.clone()
        sparse = sparse_reduce_scatter(grad, touched)
        assert torch.equal(grad, before)
        dense = grad.clone()
        dist.all_reduce(dense)  # the dense reduction, then this rank's shard of the mean
        rows = n // world
        dense = dense[rows * rank : rows * (rank + 1)] / world
        worst = max(worst, (sparse - dense).abs().max().item())
        equal &= torch.equal(sparse, dense)
    return {"max_abs_diff": worst, "equal": equal}
