"""The untimed warm-up the rules require (2025-02 on): before the clock starts, run every shape the
compiled model will see (a training step of each stage, and the validation forward) on real data,
then put model, optimizer, loader and RNG back, so timed steps never compile and the run computes
exactly what it would have without the warm-up. (Per-run table builds stay inside the timed steps.)
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from speedrun.config import Config
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.step import train_step


def is_compiled(train_model: torch.nn.Module) -> bool:
    """Whether the module the forwards run through (perhaps inside DDP) is a torch.compile'd one."""
    inner = getattr(train_model, "module", train_model)
    return isinstance(inner, torch._dynamo.eval_frame.OptimizedModule)


def warmup_steps(cfg: Config, start: int) -> list[int]:
    """Steps whose shapes differ: today one training shape per run (windows are tensors, so the window
    schedule does not recompile); with stage plans, the first step of each stage joins here."""
    return [start]


def warm_up(
    cfg: Config,
    model: torch.nn.Module,
    train_model: torch.nn.Module,
    optimizer,
    loader,
    accumulation_steps: int,
    dtype: torch.dtype | None,
    validate: Callable[[], object],
    start: int = 0,
) -> int:
    """Run the warm-up steps and one validation pass, then restore everything; returns the steps run.

    `validate` runs the validation forward (the loop's `evaluate`, limited to one batch per process).
    """
    saved_model = copy.deepcopy(model.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_loader = loader.state_dict()
    saved_rng = torch.get_rng_state()
    saved_cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    steps = warmup_steps(cfg, start)
    for step in steps:
        apply_schedule(schedule_at(step, cfg), optimizer, model)
        train_step(train_model, optimizer, loader.next_batch, accumulation_steps, dtype, cfg.optim.grad_clip)
    validate()
    with torch.no_grad():
        model.load_state_dict(saved_model)
    optimizer.load_state_dict(saved_optimizer)
    optimizer.zero_grad(set_to_none=True)
    loader.load_state_dict(saved_loader)
    torch.set_rng_state(saved_rng)
    if saved_cuda_rng is not None:
        torch.cuda.set_rng_state(saved_cuda_rng)
    return len(steps)
