"""Everything that changes with the step, as pure functions of the step (so a resume is exact): LR
multiplier, Muon momentum and window, or with `train.stages` the stage plan's values (train/stages.py);
`apply_schedule` writes them into the param groups (by `kind`) and the model."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from speedrun.config import Config, OptimConfig, TrainConfig
from speedrun.config.families import model_facts
from speedrun.config.stages import StagePlan, stage_plan
from speedrun.model import families
from speedrun.optim.normuon import momentum_at
from speedrun.train.stages import (
    StageValues,
    long_window_history,
    short_window_history,
    stage_bounds,
    stage_values,
)


@dataclass(frozen=True)
class StepSchedule:
    """The values in force while optimizer step `step` runs (and while validating before it)."""

    lr: float  # multiplier of every group's peak LR
    muon_momentum: float
    window: int  # sliding attention window in tokens; 0 = the model has none
    stage: StageValues | None = None  # with train.stages: the stage's batch, document cut and windows
    yarn: tuple[int, ...] = field(default=())  # model.yarn: the long windows (blocks) so far, in order
    yarn_short: tuple[int, ...] = field(default=())  # the short windows so far (#92's narrow layers' YaRN)
    frozen: bool = False  # labels that pause at transitions (optim.scalar_freeze_steps) are paused
    grad_scale: float = 1.0  # every gradient's factor before the optimizer step (train.summed_loss_ranks)
    power_cool: float = math.inf  # optim.power_cool_*: max(0, end − s)^power; a group's LR ≤ its c times it


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Fraction of the peak LR at 0-based optimizer step `step`.

    trapezoid: warmup `(s + 1) / warmup`, constant, then over the last W steps `f + (1 − f)·(N − s)/W`
      (f = `final_lr_frac`; Sub3Min is `warmdown_frac = 0.4`, `final_lr_frac = 0.1`).
    cosine (llm.c `get_learning_rate`): the same warmup, then `f + (1 − f)·(1 + cos(π·r))/2`,
      r = (s − warmup)/(N − warmup)."""
    floor = cfg.final_lr_frac
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    length = cfg.warmdown_span()
    if length <= 0:
        return 1.0
    w = min((cfg.steps - step) / length, 1.0)
    return w if floor == 0 else w + (1 - w) * floor


def muon_momentum(step: int, cfg: OptimConfig, total_steps: int = 0) -> float:
    """Muon momentum, warmed up linearly from `muon_momentum_start` to `muon_momentum` (and, with a
    cooldown, back down over the last steps of `total_steps`: optim/normuon.momentum_at)."""
    if cfg.muon_momentum_cooldown_steps > 0:
        return momentum_at(
            step,
            total_steps,
            cfg.muon_momentum_warmup_steps,
            cfg.muon_momentum_cooldown_steps,
            cfg.muon_momentum_start,
            cfg.muon_momentum,
        )
    if cfg.muon_momentum_warmup_steps <= 0:
        return cfg.muon_momentum
    frac = min(1.0, step / cfg.muon_momentum_warmup_steps)
    return (1 - frac) * cfg.muon_momentum_start + frac * cfg.muon_momentum


def window_tokens(step: int, total_steps: int, model_cfg: Any) -> int:
    """Sliding window (tokens) at `step` of `total_steps` (0: none); W = window, s0 = window_warmup_start,
    u = window_unit (the model's facts), integer arithmetic, full window at step N.
    none: W (2024-11-19: 1024). floor (2024-11-24 … 12-08): u·floor((s0 + (W − s0)·step/N) / u).
    ceil (Sub3Min): u·max(1, ceil((W − s0)·step/N / u))."""
    f = model_facts(model_cfg)
    W = f.window
    if W <= 0 or f.window_warmup == "none":
        return max(0, W)
    s0, u, n = f.window_warmup_start, f.window_unit, max(1, total_steps)
    step = min(max(0, step), n)
    if f.window_warmup == "floor":
        units = (s0 * n + (W - s0) * step) // (u * n)
    else:
        units = -(-((W - s0) * step) // (u * n))  # ceil division
    return max(u, u * units)


def frozen_at(step: int, span: int, transition: Callable[[int], bool]) -> bool:
    """Record #52's pause: `span` steps from each step where `transition(s)` (a new window or batch) is
    true, the transition included; a transition inside a pause restarts it."""
    return span > 0 and any(transition(s) for s in range(max(1, step - span + 1), step + 1))


def window_transition(step: int, cfg: Config) -> bool:
    """Whether step `step` (>= 1) trains with another attention window than the step before."""
    n = cfg.train.steps
    return window_tokens(step, n, cfg.model) != window_tokens(step - 1, n, cfg.model)


def stage_transition(step: int, plan: StagePlan) -> bool:
    """Whether step `step` starts a stage after the first (its batch and windows change there): the
    transitions of a stage plan, as HEAD's `get_transition_steps`."""
    return any(step == start for start, _ in stage_bounds(plan)[1:])


def schedule_at(step: int, cfg: Config) -> StepSchedule:
    """All per-step values for step `step`; `step == cfg.train.steps` is the final validation. With
    `train.stages` every value comes from `stage_values` (the record's stage plan)."""
    plan = stage_plan(cfg)
    if plan is not None:
        v = stage_values(step, plan)
        on = model_facts(cfg.model).yarn
        yarn = long_window_history(step, plan) if on else ()
        short = short_window_history(step, plan) if on else ()
        frozen = frozen_at(step, cfg.optim.scalar_freeze_steps, lambda s: stage_transition(s, plan))
        scale = grad_scale(v.batch_tokens, cfg.train)
        return StepSchedule(
            v.lr, v.muon_momentum, 0, stage=v, yarn=yarn, yarn_short=short, frozen=frozen, grad_scale=scale
        )
    last = max(0, cfg.train.steps - 1)
    return StepSchedule(
        lr=lr_multiplier(min(step, last), cfg.train),
        muon_momentum=muon_momentum(step, cfg.optim, cfg.train.steps),
        window=window_tokens(step, cfg.train.steps, cfg.model),
        frozen=frozen_at(step, cfg.optim.scalar_freeze_steps, lambda s: window_transition(s, cfg)),
        grad_scale=grad_scale(cfg.train.global_batch_tokens, cfg.train),
        power_cool=power_cool(step, cfg.optim),
    )


def power_cool(step: int, o: OptimConfig) -> float:
    """#46's PowerCool without its constant: max(0, end − step)^power (inf when off). Each group's LR
    is then min(scheduled LR, c·this) with its own c (`apply_schedule`): flat until the group's knee."""
    return max(0.0, o.power_cool_end - step) ** o.power_cool_power if o.power_cool_end else math.inf


def grad_scale(step_tokens: int, cfg: TrainConfig) -> float:
    """The gradients' factor for a step of `step_tokens` tokens: the records' summed loss over
    `summed_loss_ranks` ranks, else 1, times `grad_scale_mul` (#65: 2); the same on any process count."""
    n = cfg.summed_loss_ranks
    return (step_tokens / n if n > 0 else 1.0) * cfg.grad_scale_mul


def apply_schedule(values: StepSchedule, optimizer, model: torch.nn.Module) -> tuple[float, float]:
    """Write `values` into the param groups and the model. Each group carries its peak `initial_lr`
    and a `kind` ("adam" or "muon"); only Muon groups have a scheduled momentum. Returns the least and
    the most LR multiplier applied (group LR over its peak): PowerCool caps each group apart, so these,
    not `values.lr`, are what the log reports."""
    applied = []
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * values.lr
        multiplier = values.lr  # as given: (peak x m) / peak need not round back to m
        if "power_c" in group and group["power_c"] * values.power_cool < group["lr"]:  # optim.power_cool_c
            group["lr"] = group["power_c"] * values.power_cool
            multiplier = group["lr"] / group["initial_lr"]
        if group["initial_lr"] > 0:
            applied.append(multiplier)
        if group["kind"] == "muon":
            group["momentum"] = values.muon_momentum
        if "frozen" in group:
            group["frozen"] = values.frozen
    apply_to_model(values, model)
    return (min(applied), max(applied)) if applied else (values.lr, values.lr)


def apply_to_model(values: StepSchedule, model: torch.nn.Module) -> None:
    """The model's part of the schedule (window, or the stage's windows, YaRN and MTP weights), written by
    its family; also what a finished run is evaluated with (`schedule_at(train.steps, cfg)`)."""
    if values.stage is not None or values.window > 0:  # else nothing to write
        families.apply_schedule(model, values)


def tokens_through(steps: int, cfg: Config) -> int:
    """Training tokens of the first `steps` optimizer steps (stages change the tokens per step)."""
    plan = stage_plan(cfg)
    if plan is None:
        return steps * cfg.train.global_batch_tokens
    total = 0
    for i, (start, end) in enumerate(stage_bounds(plan)):
        total += max(0, min(end, steps) - start) * plan.stages[i].batch_tokens
    return total
