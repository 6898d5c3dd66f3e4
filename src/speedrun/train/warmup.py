"""The untimed warm-up the rules require (2025-02 on): run every shape the compiled model will see (a
step of each stage, the validation forward) on real data, then restore model, optimizer, loader and
RNG, so timed steps never compile and the run computes exactly what it would have without it."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from speedrun.config import Config
from speedrun.config.stages import stage_plan
from speedrun.model.families import family_of
from speedrun.perf import graphs
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.stages import candidate_changes, stage_at, stage_bounds
from speedrun.train.step import train_step


def is_compiled(train_model: torch.nn.Module) -> bool:
    """Whether the module the forwards run through (perhaps inside DDP) is a torch.compile'd one."""
    inner = getattr(train_model, "module", train_model)
    return isinstance(inner, torch._dynamo.eval_frame.OptimizedModule)


def warmup_steps(cfg: Config, start: int) -> list[int]:
    """Steps whose shapes differ: one training shape per run (windows are tensors), plus with
    `train.stages` the first step of every later stage (new batch, windows and YaRN constants) and every
    step where #92's candidate count P changes."""
    plan = stage_plan(cfg)
    if plan is None:
        return [start]
    firsts = {a for a, _ in stage_bounds(plan)[1:]} | set(candidate_changes(plan))
    return [start, *sorted(a for a in firsts if start < a < plan.total_steps)]


def validation_steps(cfg: Config, start: int) -> list[int]:
    """One step per validation shape still to come: with stages, the stages that validate and the final
    validation (its longer window); without stages none (the one validation covers it)."""
    plan = stage_plan(cfg)
    if plan is None:
        return []
    t, keys = cfg.train, {}
    for step in [*(range(0, t.steps, t.val_every) if t.val_every > 0 else []), t.steps]:
        if step >= start:
            keys.setdefault((stage_at(step, plan)[0], step == t.steps), step)
    return list(keys.values())


def loader_at(loader, step: int) -> None:
    """Point a document loader at `step`, so its next batch has that stage's size (warm-up only)."""
    state = loader.state_dict()
    if state.get("step", step) != step:
        loader.load_state_dict({**state, "step": step})


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
    """Run the warm-up steps and validations (`validate`: one batch per process; one per validating stage),
    then restore everything; returns the training steps run."""
    saved_model = copy.deepcopy(model.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_loader = loader.state_dict()
    saved_rng = torch.get_rng_state()
    saved_cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    steps, val_steps = graphs.warmup_steps(optimizer, warmup_steps(cfg, start)), validation_steps(cfg, start)
    if val_steps:  # a graph per stage for training and for validation: more than dynamo's default 8
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 2 * (len(steps) + len(val_steps)))
    after_step = family_of(model.cfg).after_step  # #84/#89's FP8 copies: looked up once, not per step
    for step in steps:
        sched = schedule_at(step, cfg)
        apply_schedule(sched, optimizer, model)
        if val_steps:
            loader_at(loader, step)
        clip, scale = cfg.optim.grad_clip, sched.grad_scale
        after_step(model, step - 1)  # as the loop
        train_step(train_model, optimizer, loader.next_batch, accumulation_steps, dtype, clip, scale)
    for step in val_steps:
        apply_schedule(schedule_at(step, cfg), optimizer, model)
        validate()
    if not val_steps:
        validate()
    graphs.seal(optimizer)  # CUDA graphs: every key captured and checked, none captured on the clock
    with torch.no_grad():
        model.load_state_dict(saved_model)
    optimizer.load_state_dict(saved_optimizer)
    optimizer.zero_grad(set_to_none=True)
    loader.load_state_dict(saved_loader)
    torch.set_rng_state(saved_rng)
    if saved_cuda_rng is not None:
        torch.cuda.set_rng_state(saved_cuda_rng)
    return len(steps)
