"""A table sharded by rows over the processes (#92's n-gram table, track_1_short/sharded_rows.py): process r
holds rows [r·n/world, (r + 1)·n/world), no process holds the whole table, and a step moves only the rows
its tokens read.

Before the forward, `pull` takes the step's row ids, keeps their sorted distinct set ("want"), sends each
owner the ids it owns (all-to-all of counts, then of ids), and the owners send those rows back: the rows
land in a compact leaf (`Pulled.cache`, want order) that the model part reads instead of its table
(model/gpt2026/ngram.py), so the backward's gradient lands on that leaf, never on a table-sized
tensor. After the backward, `push` sends each pulled row's gradient back along the same routes reversed;
each owner gets the gradients of exactly its touched rows (a row read by several processes once per
process), divided by the world size: the mean over processes that data-parallel training takes. On one
process (or without a process group) nothing is sent, and pull/push are the plain lookup and its
gradient. Plain torch.distributed all-to-all: gloo on CPU, NCCL on CUDA.

`full_state` gathers the table and its RowAdam state (optim/row_adam.py) on rank 0 for a checkpoint;
`load_full_state` takes this process's rows of one, saved on any number of processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from speedrun.model.labels import label, label_of


@dataclass
class Pulled:
    """One forward's pulled rows: `want` (sorted distinct global ids, then padding), the rows in that order
    in `cache` (a leaf that gets the gradient), and the routes back."""

    want: Tensor
    cache: Tensor
    lo: int  # want[lo:hi] are this process's own rows
    hi: int
    n: int  # want[:n] are the distinct ids, want[n:] padding (the table's row count, past every id)
    send_counts: list[int]  # ids asked of each process (0 for ourselves)
    recv_counts: list[int]  # ids each process asked of us
    asked: Tensor  # the global ids asked of us, by process


def _world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _all_to_all(send: Tensor, send_counts: list[int], recv_counts: list[int], group) -> Tensor:
    """Rows send[Σ send_counts[:r] : Σ send_counts[:r+1]] go to process r; received by process."""
    out = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=group)
    return out


class RowShard:
    """This process's rows of a table of `num_rows` rows (`shard`, (num_rows/world, d)) and its exchanges."""

    def __init__(self, shard: Tensor, num_rows: int, group=None, local: bool = False):
        """`local`: this process alone holds the whole table, whatever the process group."""
        self.group = group
        self.rank, self.world = (0, 1) if local else _world(group)
        assert num_rows % self.world == 0, "the table's rows must split evenly over the processes"
        self.per_rank = num_rows // self.world
        assert shard.shape[0] == self.per_rank, f"shard of {shard.shape[0]} rows, expected {self.per_rank}"
        self.shard, self.num_rows = shard, num_rows
        self.first = self.rank * self.per_rank

    @torch.no_grad()
    def pull(self, ids: Tensor) -> Pulled:
        """The rows of `ids` (any shape, int64 global ids) from their owners (a collective). The pulled set
        has one slot per id whatever the tokens (distinct ids first, then `num_rows` as padding, zero
        rows): a compiled forward that reads it sees the same shapes every step."""
        distinct = torch.unique(ids.reshape(-1))
        n = distinct.numel()
        want = torch.cat([distinct, distinct.new_full((ids.numel() - n,), self.num_rows)])
        bounds = torch.arange(self.world + 1, device=want.device) * self.per_rank
        cuts = torch.searchsorted(distinct, bounds).tolist()
        lo, hi = cuts[self.rank], cuts[self.rank + 1]
        cache = self.shard.new_zeros(want.numel(), self.shard.shape[1])
        cache[lo:hi] = self.shard[want[lo:hi] - self.first]
        send = [0 if r == self.rank else cuts[r + 1] - cuts[r] for r in range(self.world)]
        recv, asked = [0] * self.world, want[:0]
        if self.world > 1:
            counts = torch.tensor(send, dtype=torch.int64)
            recv_t = torch.empty_like(counts)
            dist.all_to_all_single(recv_t, counts, group=self.group)
            recv = recv_t.tolist()
            peer = torch.cat([want[:lo], want[hi:n]])
            asked = _all_to_all(peer, send, recv, self.group)
            served = self.shard[asked - self.first]
            got = _all_to_all(served, recv, send, self.group)
            cache[:lo], cache[hi:n] = got[:lo], got[lo:]
        return Pulled(want, cache.requires_grad_(), lo, hi, n, send, recv, asked)

    @torch.no_grad()
    def push(self, pulled: Pulled) -> tuple[Tensor, Tensor]:
        """After the backward: (local row ids, their gradients / world) of this process's touched rows, a
        row once per process that read it (a collective). Rows read but given no gradient get zeros."""
        grad = pulled.cache.grad
        if grad is None:
            grad = torch.zeros_like(pulled.cache)
        lo, hi = pulled.lo, pulled.hi
        rows, grads = [pulled.want[lo:hi] - self.first], [grad[lo:hi]]
        if self.world > 1:
            wire = torch.cat([grad[:lo], grad[hi : pulled.n]])
            grads.append(_all_to_all(wire, pulled.send_counts, pulled.recv_counts, self.group))
            rows.append(pulled.asked - self.first)
        return torch.cat(rows), torch.cat(grads) / self.world

    def full_state(self, optimizer_state: dict) -> dict | None:
        """The whole table and its per-row optimizer state (RowAdam.state_dict of this shard), gathered on
        rank 0 in row order (None elsewhere); the history is the same on every process."""
        per_row = {"table": self.shard, **{k: v for k, v in optimizer_state.items() if isinstance(v, Tensor)}}
        out = {k: v for k, v in optimizer_state.items() if not isinstance(v, Tensor) and v is not None}
        for name, t in per_row.items():
            if self.world == 1:
                out[name] = t.detach().clone()
                continue
            parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
            dist.gather(t.detach().contiguous(), parts, dst=0, group=self.group)
            if self.rank == 0:
                out[name] = torch.cat(parts)
        return out if self.rank == 0 else None

    def load_full_state(self, state: dict) -> dict:
        """This process's rows of a `full_state` (saved on any number of processes): the table is copied
        into the shard; returns the optimizer state of these rows (for RowAdam.load_state_dict)."""
        assert state["table"].shape[0] == self.num_rows, "a table of another size"
        mine = slice(self.first, self.first + self.per_rank)
        self.shard.copy_(state["table"][mine])
        return {k: (v[mine] if isinstance(v, Tensor) else v) for k, v in state.items() if k != "table"}


def shard_part(part, group=None, local: bool = False) -> RowShard:
    """Keep only this process's rows of a part's `table` (model/gpt2026/ngram.py): the part's table becomes
    its shard (labelled as before), and its forwards read the rows `RowShard.pull` sets as `part.pulled`."""
    rank, world = (0, 1) if local else _world(group)
    per_rank = part.table.shape[0] // world
    rows = part.table.data[rank * per_rank : (rank + 1) * per_rank]
    lab = label_of(part.table)
    part.table = torch.nn.Parameter(rows.clone() if world > 1 else rows, requires_grad=False)
    part.sharded = True
    if lab is not None:
        label(part.table, lab.name, blocks=lab.blocks, lr_mul=lab.lr_mul)
    return RowShard(part.table.data, part.table.shape[0] * world, group, local)
