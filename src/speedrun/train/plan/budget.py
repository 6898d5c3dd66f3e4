"""A run that fits a time budget: `train.time_budget_s` sets the step count from measured step times
(hosts differ ~20x, bf16 ~100x); `train.steps` is then the most the run may take.

After `PROBE_STEPS` timed steps the count is planned from the median step time of the recent log
intervals, and planned again at each log point while the LR is constant; a new plan replaces the old
only when it differs by more than `HYSTERESIS`. The plan is final when the warm-down starts (config.json
is rewritten with it, budget 0, so a resume continues exactly); in the warm-down it may only be cut, when
the rest would overrun the budget by more than `HYSTERESIS` (the LR falls faster, never rises). Every plan
keeps the steps done and the LR's warm-up (`train.warmup_steps`), then the warm-down: `train.warmdown_steps`,
or with `train.warmdown_frac` that share of the plan itself, so a slow host's short run gets a short
warm-down instead of overrunning its budget.
A budget that cannot act (`train.steps` ends before its first plan plus the warm-down) is refused when
the user set it, else skipped with a log line, as is a recipe's budget when the user fixed `train.steps`."""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable

from speedrun.config import Config
from speedrun.errors import ConfigError

PROBE_STEPS = 4  # timed steps measured before the first plan
RECENT = 8  # log intervals whose median step time plans the rest of the run
HYSTERESIS = 0.1  # a new plan replaces the old only when they differ by more than this fraction


def schedule_tail(cfg: Config, steps: int) -> int:
    """Steps at the end of a `steps`-step run whose schedule depends on the step count (the LR warm-down,
    Muon's momentum cool-down): a plan never starts them before the steps already done."""
    return max(math.ceil(cfg.train.warmdown_span(steps)), cfg.optim.muon_momentum_cooldown_steps)


def _tail_named(cfg: Config, steps: int) -> str:
    """schedule_tail's steps named by the setting they come from (issue 46: a 50-step Muon momentum
    cool-down was called "the warm-down")."""
    warmdown, cooldown = math.ceil(cfg.train.warmdown_span(steps)), cfg.optim.muon_momentum_cooldown_steps
    if cooldown > warmdown:
        return f"Muon's momentum cool-down ({cooldown}, optim.muon_momentum_cooldown_steps)"
    t = cfg.train
    how = "train.warmdown_steps" if t.warmdown_steps else f"train.warmdown_frac {t.warmdown_frac:g}"
    return f"the warm-down ({warmdown}, {how})"


def settle_budget(cfg: Config, log: Callable[[str], None]) -> None:
    """Decide, before anything runs, whether `cfg`'s time budget applies; when it cannot (see the module
    doc) drop it in place with one log line, or refuse it (ConfigError) when the user set it."""
    t = cfg.train
    if t.time_budget_s <= 0:
        return
    given = {"train.time_budget_s", "train.budget_min_steps"} & cfg.fixed
    first, tail = t.timing_warmup_steps + PROBE_STEPS, schedule_tail(cfg, t.steps)  # first plan, warm-down
    if "train.steps" in cfg.fixed and not given:
        why = f"train.steps={t.steps} was given, so the run trains exactly that many steps"
    elif first + tail > t.steps:
        why = (
            f"train.steps ({t.steps}) ends before the count is planned at step {first} "
            f"(train.timing_warmup_steps {t.timing_warmup_steps} + {PROBE_STEPS} measured) "
            f"plus {_tail_named(cfg, t.steps)}"
        )
        if given:
            fewest = floor_steps(first, functools.partial(schedule_tail, cfg))
            raise ConfigError(f"train.time_budget_s={t.time_budget_s:g} cannot act: {why}; raise "
                              f"train.steps to at least {fewest} or set train.time_budget_s=0")  # fmt: skip
    else:
        return
    log(f"time budget: skipped ({why}); train.time_budget_s=0 in config.json")
    t.time_budget_s, t.budget_min_steps = 0.0, 0


def plan_steps(
    budget_s: float,
    timed_s: float,
    timed_steps: int,
    untimed: int,
    step_s: float,
    done: int,
    tail: Callable[[int], int],
    cap: int,
) -> int:
    """Steps whose timed part fits `budget_s` (the timed steps so far, the time left at `step_s` a step, the
    `untimed` warm-up), at most `cap` (train.steps) and at least the floor: the fewest N with the warm-down
    of N, `tail(N)`, starting after the steps `done`."""
    assert step_s > 0 and budget_s > 0, (step_s, budget_s)
    fits = untimed + timed_steps + math.floor(max(0.0, budget_s - timed_s) / step_s)
    return max(floor_steps(done, tail), min(cap, fits))


def floor_steps(done: int, tail: Callable[[int], int]) -> int:
    """The fewest steps N whose warm-down `tail(N)` starts no earlier than after step `done`."""
    n = done + tail(done)
    while n < done + tail(n):  # a share of N grows with N (below N): a few rounds at most
        n = done + tail(n)
    return n


class Budget:
    """The planned step count of one budgeted run. `steps` is the current plan (the cap, `train.steps`,
    before the first); `observe` records each log interval and returns a log line when the plan changes."""

    def __init__(self, cfg: Config, steps: int | None = None):
        t = cfg.train
        self.budget_s, self.cap, self.untimed = t.time_budget_s, t.steps, t.timing_warmup_steps
        self.warmup = t.warmup_steps  # the LR's warm-up: a plan holds it and then its warm-down
        self.tail = functools.partial(schedule_tail, cfg)  # steps of the warm-down of an N-step plan
        self.steps = steps if steps is not None else t.steps
        self.planned = steps is not None
        self.recent: list[float] = []  # seconds per step of the last timed log intervals
        self.floored = False  # the plan is the schedule's floor, not what fits the budget

    def observe(
        self, done: int, interval_s: float, interval_steps: int, timed_s: float, timed_steps: int
    ) -> str | None:
        """After the log point at step `done`: the last interval (timed part only) and the clock's totals."""
        if interval_steps > 0:
            self.recent = [*self.recent, interval_s / interval_steps][-RECENT:]
        if timed_steps < PROBE_STEPS or not self.recent:
            return None
        step_s = statistics.median(self.recent)
        if self.final(done):
            return self._end_sooner(done, timed_s, timed_steps, step_s)
        start = max(done, self.warmup)  # the warm-down starts after both
        plan = plan_steps(
            self.budget_s, timed_s, timed_steps, self.untimed, step_s, start, self.tail, self.cap
        )
        settled = self.planned and abs(plan - self.steps) <= HYSTERESIS * self.steps
        if settled and self.steps >= start + self.tail(self.steps):
            return None
        before, self.steps, self.planned = self.steps, plan, True
        self.floored = plan <= floor_steps(start, self.tail)  # budget spent: the warm-down runs in full
        was = f"{before}, the most" if before == self.cap else before
        over = ""
        ends = timed_s + (plan - done) * step_s
        if self.floored and ends > self.budget_s:  # say it, do not hide it
            over = (
                f"; the budget is spent: the fewest steps a plan can have (step {start} and its "
                f"{self.tail(plan)}-step warm-down) run past it, to about {ends:.1f}s"
            )
        return (
            f"time budget {self.budget_s:g}s: {plan} steps (was {was}): {timed_s:.1f}s used in {timed_steps} "
            f"timed steps, median {step_s * 1000:.0f} ms/step over the last {len(self.recent)} log intervals"
            + over
        )

    def final(self, done: int) -> bool:
        """Whether the plan can no longer change: the warm-down starts with the next step."""
        return self.planned and done + self.tail(self.steps) >= self.steps

    def _end_sooner(self, done: int, timed_s: float, timed_steps: int, step_s: float) -> str | None:
        """In the warm-down, cut the count when the steps left would overrun the budget by more than
        HYSTERESIS (the LR only falls faster); a plan at its floor (done + warm-down) keeps its warm-down."""
        if self.floored or timed_s + (self.steps - done) * step_s <= (1 + HYSTERESIS) * self.budget_s:
            return None
        plan = plan_steps(self.budget_s, timed_s, timed_steps, self.untimed, step_s, done, _one, self.steps)
        if plan >= self.steps:
            return None
        before, self.steps = self.steps, plan
        return (
            f"time budget {self.budget_s:g}s: ends at {plan} steps (was {before}): {timed_s:.1f}s used in "
            f"{timed_steps} timed steps, median {step_s * 1000:.0f} ms/step over the last {len(self.recent)} "
            "log intervals would overrun it; the warm-down ends sooner (the LR only falls faster)"
        )


def _one(steps: int) -> int:
    """In the warm-down a cut keeps one step after the current one (the LR only falls faster)."""
    return 1
