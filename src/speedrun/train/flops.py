"""A run's FLOPs at the windows its schedule sets: the count of model/flops.py (its one owner) read at a
step's windows, and summed over a run's steps. Here, not in model/, because the schedule is the run's."""

from __future__ import annotations

from typing import Any

from torch import nn

from speedrun.model.families import family_of
from speedrun.model.flops import StepWindows, attention_flops, matmul_params, step_flops
from speedrun.train.schedule import schedule_at, tokens_through


def step_flops_at(model: nn.Module, cfg: Any, step: int) -> float:
    """The count at 0-based optimizer step `step` of the run `cfg` describes (its schedule's windows)."""
    windows = family_of(cfg.model).step_windows(cfg.model, schedule_at(step, cfg))
    return step_flops(model, windows, seq_len=cfg.train.seq_len)


def run_flops(model: nn.Module, cfg: Any, steps: int) -> float:
    """A run's training FLOPs over its first `steps` optimizer steps: Σ tokens × the count at that step's
    windows (the schedule, so a resumed run and an old run folder's config give the same total)."""
    family = family_of(cfg.model)
    n6 = 6 * matmul_params(model)
    layers = family.attention_layers(model)
    cache: dict[StepWindows, float] = {}
    total = 0.0
    for s in range(steps):
        w = family.step_windows(cfg.model, schedule_at(s, cfg))
        if w not in cache:
            cache[w] = n6 + attention_flops(layers, w, cfg.train.seq_len)
        total += (tokens_through(s + 1, cfg) - tokens_through(s, cfg)) * cache[w]
    return total


def first_and_last(model: nn.Module, cfg: Any) -> tuple[int, int]:
    """The count at the run's first and last step's windows (the dry-run's and the log's summary)."""
    return tuple(round(step_flops_at(model, cfg, s)) for s in (0, max(0, cfg.train.steps - 1)))


__all__ = ["first_and_last", "run_flops", "step_flops_at"]
