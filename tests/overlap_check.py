"""Worker of tests/e2e/test_overlap.py, run on every rank of tests/two_processes.py's one gloo launch (through
tests/library_checks.py): a shrunk recipe with the sharded optimizer trains a few steps twice from the same
weights and data, with its reductions launched after the backward (optim/sharded.py's own path) and from
backward hooks (perf/overlap.py), and reports whether the parameters agree bit for bit and where each
reduction was issued.

    python -m torch.distributed.run --standalone --nproc_per_node=4 -m tests.overlap_check
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from speedrun.optim.sharded import Collectives
from speedrun.perf.overlap import BackwardReductions
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.step import autocast_dtype, train_step
from tests.recipe_matrix import build, rows, shrunk

#: two micro-batches per rank (the hooks arm on the last only), an Adam step every other step, the head
#: untied at step 2 (demo-normuon), bf16 banks through the mantissa (record-2026-07), a grad_scale that is
#: not a power of two (its rounding must match the plain path's)
CASES = {"demo-normuon": ("optim.tie_until=2",), "record-2026-07": ()}
STEPS, PER_RANK, GRAD_SCALE = 4, 2, 0.7  # steps; micro-batches (one sequence each) per rank; its factor


class Recording(Collectives):
    """Collectives that note each call (kind, shape) and whether a backward was running when it was issued."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bool]] = []

    def _note(self, name: str, t: torch.Tensor) -> None:
        self.calls.append((f"{name} {tuple(t.shape)}", torch._C._current_graph_task_id() != -1))

    def reduce_scatter(self, out, inp):
        self._note("reduce_scatter", inp)
        return super().reduce_scatter(out, inp)

    def all_reduce(self, t):
        self._note("all_reduce", t)
        return super().all_reduce(t)

    def all_gather(self, out, inp):
        self._note("all_gather", inp)
        return super().all_gather(out, inp)


def train(name: str, hooked: bool, rank: int, world: int) -> tuple[list[torch.Tensor], list]:
    """(parameters after STEPS steps, the collective calls in order)."""
    cfg = shrunk(name, *CASES[name])
    model, optimizer = build(cfg)
    table = optimizer.parts["table"]
    table.comms = Recording()
    if hooked:
        optimizer.overlap = BackwardReductions(table)
    for step in range(STEPS):
        sched = schedule_at(step, cfg)
        apply_schedule(sched, optimizer, model)
        x, y = _batch(step, cfg, PER_RANK * world)
        mine = iter(range(rank * PER_RANK, (rank + 1) * PER_RANK))

        def next_batch(mine=mine, x=x, y=y):
            i = next(mine)
            return rows(cfg, x[i : i + 1], y[i : i + 1])

        train_step(model, optimizer, next_batch, PER_RANK, autocast_dtype(cfg), 0.0, GRAD_SCALE)
    if optimizer.overlap is not None:
        optimizer.overlap.remove()
    return [p.detach().clone() for p in model.parameters()], table.comms.calls


def _batch(step: int, cfg, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, cfg.model.vocab_size, (n, cfg.train.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def hooked_equals_post_backward(rank: int, world: int) -> dict[str, object]:
    """Per case: parameters equal bit for bit on this rank and across ranks, the same collectives in
    the same order, how many reductions were issued inside a backward, and the accumulation count."""
    out: dict[str, object] = {}
    for name in CASES:
        plain, plain_calls = train(name, False, rank, world)
        hooked, hooked_calls = train(name, True, rank, world)
        same = all(torch.equal(a, b) for a, b in zip(plain, hooked, strict=True))
        flat = torch.cat([p.float().flatten() for p in hooked])
        peers = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(peers, flat)
        out[name] = {
            "equal": same,
            "equal_across_ranks": all(torch.equal(p, peers[0]) for p in peers),
            "same_collectives": [c for c, _ in plain_calls] == [c for c, _ in hooked_calls],
            "in_backward_plain": sum(inside for _, inside in plain_calls),
            "in_backward_hooked": sum(inside for _, inside in hooked_calls),
            "first_in_backward": hooked_calls[0][1],
            "reductions": sum(not c.startswith("all_gather") for c, _ in hooked_calls),
            "accumulation": PER_RANK,
        }
    return out


if __name__ == "__main__":  # by hand on any number of processes (4: 86 s on a busy 2-core host, all equal)
    import json

    dist.init_process_group("gloo")
    found = hooked_equals_post_backward(dist.get_rank(), dist.get_world_size())
    if dist.get_rank() == 0:
        print(json.dumps(found, indent=1))
    dist.barrier()
    dist.destroy_process_group()
