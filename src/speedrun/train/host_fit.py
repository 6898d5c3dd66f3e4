"""Fit a budgeted CPU run to the host it runs on: its size from a measured probe, compile by measurement.

CPUs differ ~20x in throughput (and bf16 ~100x), so a demo sized for one host learns nothing in its time
budget on another. With `train.time_budget_s` and `train.budget_min_steps`, `size_to_host` times one
eager forward+backward of a slice of the recipe's micro-batch (about a second on a slow CPU), estimates
the step time, and halves the batch (down to 8 sequences) and then the width (down to 64) until the
minimum number of steps fits the budget. The sizes are written into the run's config (config.json), so
the run, its resume and its evaluation use them, and the log says what changed and why.

`MeasuredCompile` decides `train.compile=auto` on a CPU by measurement: the first steps run eager, the
next ones compiled, and the faster of the two trains on. Both are the same computation, and these
steps are inside the timing warm-up, so nothing timed is lost.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from speedrun.config import Config
from speedrun.model.families import build_model
from speedrun.train.step import autocast, autocast_dtype

MIN_ROWS, MIN_WIDTH = 8, 64  # the smallest batch (sequences) and width the fit shrinks to


def probe_step_s(cfg: Config, device: torch.device) -> float:
    """Estimated seconds of one optimizer step of `cfg` on `device`: one eager forward+backward of a
    micro-batch timed after a first call, times the micro-batches per step, plus a tenth for the
    optimizer. A full micro-batch, because a slice would measure per-op overhead, not the matmuls."""
    t = cfg.train
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device)
    x = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_tokens // t.seq_len, t.seq_len), device=device)
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        with autocast(device, autocast_dtype(cfg)):
            loss = model(x, x)
        loss.backward()
        best = min(best, time.perf_counter() - start)
    return 1.1 * best * t.global_batch_tokens / t.micro_batch_tokens


def shrink(cfg: Config) -> str | None:
    """Halve the batch, else the width, in place; say what changed, or None when nothing can shrink."""
    t, m = cfg.train, cfg.model
    if t.global_batch_tokens // t.seq_len >= 2 * MIN_ROWS:
        t.global_batch_tokens //= 2
        t.micro_batch_tokens = min(t.micro_batch_tokens, t.global_batch_tokens)
        return f"train.global_batch_tokens={t.global_batch_tokens}"
    head_dim = m.n_embd // m.n_head
    if m.n_embd // 2 >= MIN_WIDTH and head_dim % 4 == 0:  # halved heads stay even for rotary
        m.n_embd //= 2
        return f"model.n_embd={m.n_embd}"
    return None


def shrinks_needed(rcfg: Config, step_s: Callable[[Config], float]) -> tuple[int, float]:
    """How many `shrink` calls it takes for `train.budget_min_steps` to fit the time budget, with
    `step_s` measuring each candidate; and the last candidate's step time."""
    t, trial, n = rcfg.train, copy.deepcopy(rcfg), 0
    seconds = step_s(trial)
    while t.time_budget_s / seconds < t.budget_min_steps and shrink(trial):
        n, seconds = n + 1, step_s(trial)
    return n, seconds


def size_to_host(
    cfg: Config, rcfg: Config, device: torch.device, log: Callable[[str], None], agree: Callable[[int], int]
) -> bool:
    """Shrink `cfg` (and its effective copy `rcfg`) until `train.budget_min_steps` fit the time budget;
    `agree` makes every process take rank 0's answer. The fit is then spent (budget_min_steps = 0), so
    a resume keeps the sizes. Returns whether anything shrank."""
    measured, seconds = shrinks_needed(rcfg, lambda c: probe_step_s(c, device))
    n = agree(measured)
    changes = [shrink(cfg) for _ in range(n)]
    for _ in range(n):
        shrink(rcfg)
    final = {str(c).split("=")[0]: str(c) for c in changes}  # a key halved twice is named once
    what = ", ".join(final.values()) if n else "the recipe's size fits"
    budget = cfg.train.time_budget_s
    fits = int(budget / seconds)
    log(f"host fit: {what} (measured {seconds * 1000:.0f} ms/step eager: ~{fits} steps in {budget:g}s)")
    cfg.train.budget_min_steps = rcfg.train.budget_min_steps = 0
    return n > 0


class MeasuredCompile:
    """`train.compile=auto` on one CPU process: eager for the first steps, compiled for the next, then
    whichever measured faster. `module(done)` is what step `done + 1` runs through."""

    EAGER_STEPS = 2  # the first includes first-call costs; the second is measured

    def __init__(self, model: torch.nn.Module, log: Callable[[str], None]):
        self.model, self.log = model, log
        self.compiled = torch.compile(model, dynamic=False, fullgraph=True)  # as build_model
        self.times: dict[int, float] = {}
        self.choice: torch.nn.Module | None = None

    @property
    def decide_at(self) -> int:
        return 2 * self.EAGER_STEPS  # the compiled steps: the first compiles, the second is measured

    def module(self, done: int) -> torch.nn.Module:
        if self.choice is not None:
            return self.choice
        return self.model if done < self.EAGER_STEPS else self.compiled

    def measured(self, done: int, seconds: float) -> None:
        """Record the wall time of step `done` (a CPU never runs ahead, so it is exact)."""
        if self.choice is not None:
            return
        self.times[done] = seconds
        if done == self.decide_at:
            eager, compiled = self.times[self.EAGER_STEPS], self.times[self.decide_at]
            self.choice = self.compiled if compiled < eager else self.model
            name = "compiled" if self.choice is self.compiled else "eager"
            self.log(
                f"compile: {name} measured faster here "
                f"({eager * 1000:.0f} ms eager, {compiled * 1000:.0f} ms compiled)"
            )
