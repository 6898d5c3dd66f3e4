"""A run's FLOPs at the windows its schedule sets: the count of model/flops.py (its one owner) read at a
step's windows, and summed over a run's steps. Here, not in model/, because the schedule is the run's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from speedrun.model.families import build_model, family_of
from speedrun.model.flops import StepWindows, attention_flops, matmul_params
from speedrun.train.schedule import schedule_at, tokens_through


def step_flops(
    model: nn.Module,
    windows: StepWindows | None = None,
    doc_lens: Sequence[int] | None = None,
    seq_len: int | None = None,
) -> float:
    """Training FLOPs per token of `model` at a step's `windows` (None: the windows of the model's
    config, `model.window` long and its short rule) over rows of `seq_len` tokens (default: the
    documents' total), with the documents' lengths where known. `bench` calls it per stage."""
    family = family_of(model.cfg)
    if windows is None:
        windows = family.step_windows(model.cfg, None)
    if seq_len is None:
        assert doc_lens, "step_flops needs seq_len or the documents' lengths"
        seq_len = sum(doc_lens)
    layers = family.attention_layers(model)
    return 6 * matmul_params(model) + attention_flops(layers, windows, seq_len, doc_lens)


def config_model(cfg: Any) -> nn.Module:
    """The model `cfg` describes, on the meta device (shapes only: for counting)."""
    with torch.device("meta"):
        return build_model(cfg.model)


def sampled_head_saving(model: nn.Module, values: Any) -> float:
    """FLOPs per token the head does not compute on a step of #92's sampled softmax: its GEMMs are P
    columns wide, not the head's V (6·d·(V − P)); 0 on full-softmax steps."""
    P = values.stage.candidates if values.stage is not None else 0
    rows, d = model.lm_head.weight.shape
    return 6 * d * (rows - P) if P else 0.0


def step_flops_at(model: nn.Module, cfg: Any, step: int) -> float:
    """The count at 0-based optimizer step `step` of the run `cfg` describes (its schedule's windows,
    and #92's candidate count where it samples)."""
    values = schedule_at(step, cfg)
    windows = family_of(cfg.model).step_windows(cfg.model, values)
    return step_flops(model, windows, seq_len=cfg.train.seq_len) - sampled_head_saving(model, values)


def run_flops(model: nn.Module, cfg: Any, steps: int) -> float:
    """A run's training FLOPs over its first `steps` optimizer steps: Σ tokens × the count at that step's
    windows and candidate count (the schedule, so a resumed run and an old run folder's config give the
    same total)."""
    family = family_of(cfg.model)
    n6 = 6 * matmul_params(model)
    layers = family.attention_layers(model)
    cache: dict[StepWindows, float] = {}
    total = 0.0
    for s in range(steps):
        values = schedule_at(s, cfg)
        w = family.step_windows(cfg.model, values)
        if w not in cache:
            cache[w] = n6 + attention_flops(layers, w, cfg.train.seq_len)
        per_token = cache[w] - sampled_head_saving(model, values)
        total += (tokens_through(s + 1, cfg) - tokens_through(s, cfg)) * per_token
    return total


def first_and_last(model: nn.Module, cfg: Any) -> tuple[int, int]:
    """The count at the run's first and last step's windows (the dry-run's and the log's summary)."""
    return tuple(round(step_flops_at(model, cfg, s)) for s in (0, max(0, cfg.train.steps - 1)))


__all__ = ["config_model", "first_and_last", "run_flops", "step_flops", "step_flops_at"]
