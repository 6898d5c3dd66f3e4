"""Compiled against eager, per recipe, on the path CUDA compiles: a recipe shrunk but keeping its
switches, compiled by inductor with static shapes (dense attention stands in for FlexAttention, which
has no CPU backward), trains a few steps while the LR, momentum and window change, beside an eager
copy with the same weights and batches. Reports graph breaks, recompiles after the first step, and the
largest loss and gradient differences. Used by tests/unit/test_compile_paths.py (a fast subset) and
benchmarks/bench_compile_matrix.py (every recipe)."""

from __future__ import annotations

import time

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from speedrun.config import Config
from speedrun.optim.build import RunOptimizer
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.step import autocast_dtype, train_step
from tests.recipe_matrix import MICRO, batch, build, shrunk
from tests.unit.test_architecture import randomize


class GradTap:
    """Passes through to the run's optimizer; keeps a copy of the gradients each `step()` applies."""

    def __init__(self, inner: RunOptimizer):
        self.inner, self.grads = inner, []

    def step(self) -> None:
        self.grads.append([p.grad.detach().clone() for p in self.inner.parameters()])
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def parameters(self):
        return self.inner.parameters()


def matrix_config(name: str, steps: int, n_layer: int, *extra: str) -> Config:
    """The shrunk recipe with a schedule that moves every step: LR in warmdown, window growing (and
    the Muon momentum in its warm-up, for the recipes that have one)."""
    overrides = [f"train.steps={steps}", f"train.warmdown_steps={steps}", "model.attention=sdpa", *extra]
    return shrunk(name, *overrides, n_layer=n_layer)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero)."""
    scale = want.detach().abs().max().float().item()
    diff = (got.detach().float() - want.detach().float()).abs().max().item()
    return diff / scale if scale > 0 else diff


def check_recipe(
    name: str,
    steps: int = 3,
    n_layer: int = 2,
    fullgraph: bool = True,
    backend: str = "inductor",
    extra: tuple[str, ...] = (),
) -> dict:
    """Train the shrunk recipe `steps` steps compiled and eager from the same random weights; return
    what differs. Gradients are compared at the first step (same weights); losses at every step (the
    weights then drift apart by rounding)."""
    torch._dynamo.reset()
    counters.clear()
    cfg = matrix_config(name, steps, n_layer, *extra)
    eager_model, eager_opt = build(cfg)
    randomize(eager_model)  # zero-init heads and projections would leave most first gradients zero
    model, opt = build(cfg)
    model.load_state_dict(eager_model.state_dict())
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=fullgraph, dynamic=False)
    taps = GradTap(eager_opt), GradTap(opt)
    losses: list[tuple[float, float]] = []
    frames_after_first, start = 0, time.perf_counter()
    for step in range(steps):
        sched = schedule_at(step, cfg)
        x, y = batch(step, cfg)
        pair = []
        for net, raw, tap in ((eager_model, eager_model, taps[0]), (compiled, model, taps[1])):
            apply_schedule(sched, tap.inner, raw)
            rows = iter(range(MICRO))

            def next_batch(rows=rows, x=x, y=y) -> tuple[torch.Tensor, torch.Tensor]:
                i = next(rows)
                return x[i : i + 1], y[i : i + 1]

            pair.append(train_step(net, tap, next_batch, MICRO, autocast_dtype(cfg)).item())
        losses.append((pair[1], pair[0]))
        if step == 0:
            frames_after_first, first_s = counter.frame_count, time.perf_counter() - start
    names = [n for n, p in model.named_parameters() if any(p is q for q in opt.parameters())]
    errors = [relative_error(g, e) for g, e in zip(taps[1].grads[0], taps[0].grads[0], strict=True)]
    return {
        "recipe": name,
        "graph_breaks": sum(counters["graph_break"].values()),
        "frames": frames_after_first,
        "recompiles_after_first_step": counter.frame_count - frames_after_first,
        "losses": losses,
        "loss_rel_error": [abs(c - e) / abs(e) for c, e in losses],
        "grad_rel_error": max(errors),  # at the first step, where both have the same weights
        "worst_grad": names[errors.index(max(errors))],
        "first_step_s": first_s,
        "bf16": cfg.model.bf16_model or cfg.model.embed_dtype == "bf16",
    }
