"""Worker of tests/unit/test_ddp_compile.py: a shrunk recipe trains a few steps through the loop's
`build_model` and `train_step` on 1 process or under torchrun with 2 gloo processes, eager or
compiled (aot_eager: the CPU stand-in for inductor), and reports its losses and how dynamo compiled it.
(under torchrun in tests/two_processes.py's one launch)
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from speedrun.optim.build import build_optimizer
from speedrun.train.distributed import DistContext
from speedrun.train.loop import build_model
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.step import train_step
from tests.recipe_matrix import EOT, SEQ, shrunk

RECIPE, STEPS, ROWS = "untied-2024-11", 3, 4  # 4 sequences a step: 2 micro-batches per rank on 2
# 2 layers 128 wide: ~2.1 MB of parameters, more than DDP's first 1 MiB bucket, so there are buckets
WIDE = ("model.n_embd=128",)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, EOT, (ROWS, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def run(compile_on: bool, rank: int = 0, world: int = 1) -> dict:
    """Losses of STEPS steps (mean over the global batch) and dynamo's account of the compilation."""
    torch._dynamo.reset()
    counters.clear()
    cfg = shrunk(RECIPE, *WIDE, f"train.compile={'on' if compile_on else 'off'}", n_layer=2)
    counter = CompileCounterWithBackend("aot_eager")
    real_compile = torch.compile
    torch.compile = functools.partial(real_compile, backend=counter)  # build_model's call, on aot_eager
    try:
        model, train_model = build_model(cfg, DistContext(rank, rank, world, torch.device("cpu")))
    finally:
        torch.compile = real_compile
    optimizer = build_optimizer(model, cfg)
    accum = ROWS // world
    losses = []
    for step in range(STEPS):
        apply_schedule(schedule_at(step, cfg), optimizer, model)
        x, y = batch(step)
        rows = iter(range(rank * accum, (rank + 1) * accum))

        def next_batch(rows=rows, x=x, y=y):
            i = next(rows)
            return x[i : i + 1], y[i : i + 1]

        loss = train_step(train_model, optimizer, next_batch, accum, None)
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return {
        "losses": losses,
        "wrapper": type(train_model).__name__,
        "compiled_pieces": counter.frame_count,  # graphs handed to the backend
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def eager_and_compiled(rank: int, world: int) -> dict[str, dict]:
    """Both runs on this rank; run by tests/library_checks.py under torchrun."""
    return {"eager": run(False, rank, world), "compiled": run(True, rank, world)}
