"""Everything that changes with the step, computed in one place as pure functions of the step.

For optimizer step s the schedule gives the LR multiplier, the Muon momentum and the attention window;
`apply_schedule` writes them into the optimizer's param groups (by the group's `kind`, never by
optimizer name) and the model. Pure functions of the step, so a resumed run is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from speedrun.config import Config, ModelConfig, OptimConfig, TrainConfig
from speedrun.optim.normuon import momentum_at


@dataclass(frozen=True)
class StepSchedule:
    """The values in force while optimizer step `step` runs (and while validating before it)."""

    lr: float  # multiplier of every group's peak LR
    muon_momentum: float
    window: int  # sliding attention window in tokens; 0 = the model has none
    frozen: bool = False  # labels that pause at transitions (optim.scalar_freeze_steps) are paused


def warmdown_length(cfg: TrainConfig) -> float:
    """Warmdown span in steps: `warmdown_frac` of the run when set (Sub3Min: 0.4, fractional), else
    `warmdown_steps`."""
    return cfg.warmdown_frac * cfg.steps if cfg.warmdown_frac > 0 else float(cfg.warmdown_steps)


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Fraction of the peak LR at 0-based optimizer step `step` (0 <= step < cfg.steps).

    trapezoid (the records): warmup `(s + 1) / warmup` over `warmup_steps`, then constant, then over
      the last W steps `w = (N − s) / W` (1 on the first warmdown step, 1/W on the last), with the floor
      f = `final_lr_frac` mixed in as `f + (1 − f)·w`. Sub3Min's `w = min((1 − s/N)/0.4, 1)`,
      `lr = w + (1 − w)·0.1` is this with `warmdown_frac = 0.4` and `final_lr_frac = 0.1`.
    cosine (llm.c `get_learning_rate`): the same warmup, then `f + (1 − f)·(1 + cos(π·r))/2` with
      r = (s − warmup)/(N − warmup), so the last step (r = (N − 1 − warmup)/(N − warmup)) is just above f.
    """
    floor = cfg.final_lr_frac
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    length = warmdown_length(cfg)
    if length <= 0:
        return 1.0
    w = min((cfg.steps - step) / length, 1.0)
    return w if floor == 0 else w + (1 - w) * floor


def muon_momentum(step: int, cfg: OptimConfig, total_steps: int = 0) -> float:
    """Muon momentum, warmed up linearly from `muon_momentum_start` to `muon_momentum` (and, with a
    cooldown, back down over the last steps of `total_steps`: optim/normuon.momentum_at)."""
    if cfg.muon_momentum_cooldown_steps > 0:
        o = cfg
        return momentum_at(
            step,
            total_steps,
            o.muon_momentum_warmup_steps,
            o.muon_momentum_cooldown_steps,
            o.muon_momentum_start,
            o.muon_momentum,
        )
    if cfg.muon_momentum_warmup_steps <= 0:
        return cfg.muon_momentum
    frac = min(1.0, step / cfg.muon_momentum_warmup_steps)
    return (1 - frac) * cfg.muon_momentum_start + frac * cfg.muon_momentum


def window_tokens(step: int, total_steps: int, cfg: ModelConfig) -> int:
    """Sliding window (tokens) for optimizer step `step` of `total_steps`; 0 when there is no window.

    none: `cfg.window` throughout (2024-11-19: 1024).
    floor (2024-11-24 … 12-08): u·floor((s0 + (W − s0)·step/N) / u), growing from s0 to W in multiples
      of u; with s0 = 64, W = 1792, u = 64 this is 11-24's `64·floor((64 + 1728·step/N)/64)`.
    ceil (Sub3Min): u·max(1, ceil((W − s0)·step/N / u)); with s0 = 64, W = 1792, u = 128 this is
      `128·ceil(1728·step/N / 128)`, 128 → 1792 tokens.
    Here W = cfg.window, s0 = cfg.window_warmup_start, u = cfg.window_unit. Integer arithmetic, so the
    schedule is exact and identical on every rank. Step N (the final validation) gets the full window.
    """
    W = cfg.window
    if W <= 0 or cfg.window_warmup == "none":
        return max(0, W)
    s0, u, n = cfg.window_warmup_start, cfg.window_unit, max(1, total_steps)
    step = min(max(0, step), n)
    if cfg.window_warmup == "floor":
        units = (s0 * n + (W - s0) * step) // (u * n)
    else:
        units = -(-((W - s0) * step) // (u * n))  # ceil division
    return max(u, u * units)


def frozen_at(step: int, span: int, transition: Callable[[int], bool]) -> bool:
    """Record #52's pause: a span of `span` steps from each transition step on (the transition step
    included; a transition inside a pause restarts it). `transition(s)`: whether step s starts new
    schedule values (#52: a new window or batch size)."""
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
    """All per-step values for step `step`; `step == cfg.train.steps` is the final validation."""
    last = max(0, cfg.train.steps - 1)
    return StepSchedule(
        lr=lr_multiplier(min(step, last), cfg.train),
        muon_momentum=muon_momentum(step, cfg.optim, cfg.train.steps),
        window=window_tokens(step, cfg.train.steps, cfg.model),
        frozen=frozen_at(step, cfg.optim.scalar_freeze_steps, lambda s: window_transition(s, cfg)),
    )


def apply_schedule(values: StepSchedule, optimizer, model: torch.nn.Module) -> None:
    """Write `values` into the param groups and the model. Each group carries its peak `initial_lr`
    and a `kind` ("adam" or "muon"); only Muon groups have a scheduled momentum."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * values.lr
        if group["kind"] == "muon":
            group["momentum"] = values.muon_momentum
        if "frozen" in group:
            group["frozen"] = values.frozen
    if values.window > 0:
        model.set_attention_window(values.window)


# ---------------------------------------------------------------------------------------------------
# Training stages (records #46 on): the batch, the longest document, the windows, the LR multiplier
# and the multi-token-prediction weights change at stage boundaries; extension steps follow the
# scheduled ones at the final values. Every value is a pure function of the step.


@dataclass(frozen=True)
class Stage:
    """One stage. `duration` is its fraction of the scheduled steps (unused for the extension stage)."""

    batch_tokens: int  # tokens per optimizer step
    max_doc_len: int  # longest document in a training sequence (tokens; 0 = no cut)
    windows: tuple[int, int]  # (short, long) attention windows in blocks
    lr_mul: float  # LR multiplier before the cool-down
    mtp_start: tuple[float, ...] = (1.0,)  # multi-token-prediction weights at the stage's start ...
    mtp_end: tuple[float, ...] = (1.0,)  # ... and at its end (linear in between)
    duration: float = 0.0


@dataclass(frozen=True)
class StagePlan:
    """Stages (the last one is the extension), step counts and the step-wise formulas' constants."""

    stages: tuple[Stage, ...]
    scheduled_steps: int
    extension_steps: int = 0
    cooldown_frac: float = 0.5  # linear cool-down over this fraction of the scheduled steps ...
    lr_floor: float = 0.15  # ... to this LR (absolute, not a fraction of the stage's multiplier)
    split_stage: int = -1  # untie embedding and head at the first odd step of this stage (-1: never)
    val_long_window: int = 0  # long window (blocks) of the final validation; 0 = the last stage's
    momentum_min: float = 0.85
    momentum_max: float = 0.95
    momentum_warmup: int = 300
    momentum_cooldown: int = 50

    @property
    def total_steps(self) -> int:
        return self.scheduled_steps + self.extension_steps


@dataclass(frozen=True)
class StageValues:
    """The values in force while optimizer step `step` runs."""

    stage: int
    batch_tokens: int
    max_doc_len: int
    short_window: int  # blocks
    long_window: int  # blocks
    lr: float
    muon_momentum: float
    mtp_weights: tuple[float, ...]
    untied: bool


def stage_bounds(plan: StagePlan) -> list[tuple[int, int]]:
    """[start, end) of every stage: the scheduled ones at rounded cumulative fractions, then the extension."""
    ends, acc = [0], 0.0
    for stage in plan.stages[:-1]:
        acc += stage.duration
        ends.append(round(acc * plan.scheduled_steps))
    assert ends[-1] == plan.scheduled_steps, "scheduled stage durations must add up to 1"
    ends.append(plan.total_steps)
    return list(zip(ends[:-1], ends[1:], strict=True))


def stage_at(step: int, plan: StagePlan) -> tuple[int, float]:
    """Index of the stage running `step` and how far into it (0 … 1); past the end: the last, 1.0."""
    for i, (start, end) in enumerate(stage_bounds(plan)):
        if step < end:
            return i, (step - start) / (end - start)
    return len(plan.stages) - 1, 1.0


def stage_lr(step: int, plan: StagePlan) -> float:
    """The stage's multiplier, mixed linearly into `lr_floor` over the cool-down."""
    lr = plan.stages[stage_at(step, plan)[0]].lr_mul
    n = plan.scheduled_steps
    start = int(n * (1 - plan.cooldown_frac))
    if step >= start:
        t = min(1.0, (step - start) / (n - start))
        lr = lr * (1 - t) + plan.lr_floor * t
    return lr


def momentum_warmup_cooldown(step: int, plan: StagePlan) -> float:
    """Muon momentum: linear warm-up min → max, then linear cool-down to min over the last steps of
    the whole run (today's `get_muon_momentum`). Lives here until the optimizer module has it."""
    lo, hi = plan.momentum_min, plan.momentum_max
    cooldown_start = plan.total_steps - plan.momentum_cooldown
    if step < plan.momentum_warmup:
        return lo + step / plan.momentum_warmup * (hi - lo)
    if step > cooldown_start:
        return hi - (step - cooldown_start) / plan.momentum_cooldown * (hi - lo)
    return hi


def split_step(plan: StagePlan) -> int:
    """First step with embedding and head untied: the split stage's first odd step (Adam steps on odd
    steps only); past the run when never."""
    if plan.split_stage < 0:
        return plan.total_steps + 1
    return stage_bounds(plan)[plan.split_stage][0] | 1


def stage_values(step: int, plan: StagePlan) -> StageValues:
    """Everything the stage plan sets for `step`; `step == total_steps` is the final validation."""
    i, t = stage_at(step, plan)
    s = plan.stages[i]
    short, long = s.windows
    if step >= plan.total_steps and plan.val_long_window:
        long = plan.val_long_window
    return StageValues(
        stage=i,
        batch_tokens=s.batch_tokens,
        max_doc_len=s.max_doc_len,
        short_window=short,
        long_window=long,
        lr=stage_lr(step, plan),
        muon_momentum=momentum_warmup_cooldown(step, plan),
        mtp_weights=tuple(a + (b - a) * t for a, b in zip(s.mtp_start, s.mtp_end, strict=True)),
        untied=step >= split_step(plan),
    )


#: Today's record (train_gpt.py @ f411b3d3): 8 → 16 → 24 sequences of 2,048 per step, max document
#: 896 → 2,048, windows (1,3) → (3,7) → (5,11) → extension (6,13), 20 long blocks at the last validation.
STAGES_2026_07 = StagePlan(
    stages=(
        Stage(131072, 896, (1, 3), 1.0, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), duration=1 / 3),
        Stage(262144, 2048, (3, 7), 1.52, (1.0, 0.5), (1.0, 0.0), duration=1 / 3),
        Stage(393216, 2048, (5, 11), 1.73, duration=1 / 3),
        Stage(393216, 2048, (6, 13), 1.0),
    ),
    scheduled_steps=1270,
    extension_steps=15,
    cooldown_frac=0.60,
    lr_floor=0.15,
    split_stage=2,
    val_long_window=20,
)
