"""Sparse exchange of an embedding table's gradient (record #71, 2026-02-06, PR #221): the bigram hash
table (#62) has 251,520 rows, but a step's tokens touch only a few thousand of them, so a dense
reduce-scatter moves mostly zeros. Each rank instead sends every other rank just the rows it touched
inside that rank's shard (their indices, then their values, by all-to-all) and adds what it receives
to its own shard: the same mean as the reduce-scatter, for the rows' sizes in traffic.

Plain torch.distributed (all_to_all_single); the caller keeps the touched rows (the record marks them
over the steps an Adam update gathers, on the host, from its bigram indices).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


@torch.no_grad()
def sparse_reduce_scatter(grad: Tensor, touched: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's shard (rows N/world · rank …) of the mean over ranks of ``grad`` (N, d), each rank's
    gradient being zero outside its ``touched`` rows (sorted, distinct, int64). Returns a new tensor;
    ``grad`` is left as it was. Equal to reduce_scatter(AVG) of the dense gradients (#71)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n, d = grad.shape
    assert n % world == 0, "the table's rows must split evenly over the ranks"
    rows = n // world
    bounds = torch.searchsorted(touched, torch.arange(0, rows * (world + 1), rows, device=touched.device))
    send_counts = bounds[1:] - bounds[:-1]
    send_counts[rank] = 0  # own rows are already in the shard below
    send_idx = torch.cat([touched[: bounds[rank]], touched[bounds[rank + 1] :]])
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()
    recv_idx = torch.empty(sum(recv_sizes), dtype=send_idx.dtype, device=grad.device)
    dist.all_to_all_single(recv_idx, send_idx, recv_sizes, send_sizes, group=group)
    recv_vals = torch.empty(sum(recv_sizes) * d, dtype=grad.dtype, device=grad.device)
    send_vals = grad[send_idx].reshape(-1)
    dist.all_to_all_single(
        recv_vals, send_vals, [c * d for c in recv_sizes], [c * d for c in send_sizes], group=group
    )
    shard = grad[rows * rank : rows * (rank + 1)].clone()
    shard.index_add_(0, recv_idx - rows * rank, recv_vals.view(-1, d))
    return shard.mul_(1 / world)
