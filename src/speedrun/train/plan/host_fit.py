"""Fit a budgeted CPU run to its host: compile and size chosen from a measured probe (CPUs differ ~20x).

With `train.time_budget_s` on a CPU, rank 0 times the recipe's micro-batch with every core (the same
work on 1 or 8 processes, so one command chooses one model) and every process takes its answers:
compile (`train.compile=auto`) only when `COMPILE_GAIN` faster than eager; size (`train.budget_min_steps`):
when fewer than `budget_min_steps / HYSTERESIS` steps fit, halve the batch (to 8 sequences), then the
width (to 64), never a key the user fixed (`cfg.fixed`). Timings are medians of `REPEATS` passes, redone
when they spread more than `SPREAD`; a plan to shrink is timed again before it is committed (`confirm`:
never on a transient, never on a prediction the shrunk step misses). The choices go into config.json and
one log line each (with the numbers behind them)."""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from speedrun.config import Config
from speedrun.errors import first_line
from speedrun.model.families import build_model
from speedrun.train.step import autocast, autocast_dtype

MIN_ROWS, MIN_WIDTH = 8, 64  # the smallest batch (sequences) and width the fit shrinks to
REPEATS = 3  # timed passes per probe, after a first untimed one
SPREAD = 1.3  # slowest / fastest pass above this: the load changed, so the probe measures again (once)
HYSTERESIS = 1.5  # shrink only when fewer than budget_min_steps / this fit the budget
MISS = 1.5  # a shrunk step this much slower than predicted: the load changed, the fit is planned again
COMPILE_GAIN = 0.9  # compiled is chosen when its step takes less than this fraction of the eager one


@contextlib.contextmanager
def all_cores() -> Iterator[None]:
    """Probe with every core this process may use, as one process of the run would (torchrun starts
    each process with one thread): the measurement does not depend on the process count. A single process
    whose user set OMP_NUM_THREADS trains at that many threads, so it probes at them too (issue 46: on a
    loaded host the every-core probe ran 40x slower than the 1-thread run it sized, and cut its batch 8x)."""
    before = torch.get_num_threads()
    single = os.environ.get("WORLD_SIZE", "1").strip() in ("", "1")
    if not (single and os.environ.get("OMP_NUM_THREADS", "").strip()):
        torch.set_num_threads(
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        )
    try:
        yield
    finally:
        torch.set_num_threads(before)


def probe_steps(cfg: Config, device: torch.device, with_compiled: bool = False) -> tuple[float, float]:
    """Estimated seconds of one optimizer step of `cfg` on one process, eager and (with `with_compiled`,
    else inf) compiled: median full micro-batch forward+backward × micro-batches, plus a tenth for the
    optimizer; the two are timed in turn, so a change of load slows both alike."""
    t = cfg.train
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device)
    modules = [model, torch.compile(model, dynamic=False, fullgraph=True)] if with_compiled else [model]
    x = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_tokens // t.seq_len, t.seq_len), device=device)

    def once(module: torch.nn.Module) -> float:
        start = time.perf_counter()
        with autocast(device, autocast_dtype(cfg)):
            loss = module(x, x)
        loss.backward()
        return time.perf_counter() - start

    for module in modules:
        once(module)  # first call: allocations (and compilation)
    times: list[list[float]] = [[] for _ in modules]
    for _ in range(2):  # a second round only when the first spread: the load changed meanwhile
        for _ in range(REPEATS):
            for module, seen in zip(modules, times, strict=True):
                seen.append(once(module))
        if all(max(seen) <= SPREAD * min(seen) for seen in times):
            break
    step = [1.1 * statistics.median(seen) * t.global_batch_tokens / t.micro_batch_tokens for seen in times]
    return step[0], step[1] if with_compiled else float("inf")


def shrink(cfg: Config) -> str | None:
    """Halve the batch, else the width, in place, leaving the keys in `cfg.fixed` alone; say what
    changed, or None when nothing can shrink."""
    t, m, fixed = cfg.train, cfg.model, cfg.fixed
    half = t.global_batch_tokens // 2
    micro = t.micro_batch_tokens if "train.micro_batch_tokens" in fixed else min(t.micro_batch_tokens, half)
    if "train.global_batch_tokens" not in fixed and half // t.seq_len >= MIN_ROWS and half % micro == 0:
        t.global_batch_tokens, t.micro_batch_tokens = half, micro
        return f"train.global_batch_tokens={t.global_batch_tokens}"
    head_dim = m.n_embd // m.n_head
    if "model.n_embd" not in fixed and m.n_embd // 2 >= MIN_WIDTH and head_dim % 4 == 0:  # rotary: even
        m.n_embd //= 2
        return f"model.n_embd={m.n_embd}"
    return None


def shrinks_needed(
    rcfg: Config, step_s: Callable[[Config], float], first_s: float | None = None
) -> tuple[int, float, float]:
    """How many `shrink` calls make `train.budget_min_steps` fit the budget (none while more than
    budget_min_steps / HYSTERESIS fit), and the first and last candidate's step times."""
    t, trial, n = rcfg.train, copy.deepcopy(rcfg), 0
    first = seconds = first_s if first_s is not None else step_s(trial)
    if t.time_budget_s / seconds >= t.budget_min_steps / HYSTERESIS:
        return 0, first, seconds
    while t.time_budget_s / seconds < t.budget_min_steps and shrink(trial):
        n, seconds = n + 1, step_s(trial)
    return n, first, seconds


def shrunk(rcfg: Config, n: int) -> Config:
    """A copy of `rcfg` after `n` shrinks."""
    trial = copy.deepcopy(rcfg)
    for _ in range(n):
        shrink(trial)
    return trial


def confirm(
    rcfg: Config,
    step_s: Callable[[Config], float],
    plan: tuple[int, float, float],
    log: Callable[[str], None],
) -> tuple[int, float, float]:
    """Check a plan to shrink before it is committed: the recipe's size and the shrunk step timed again.
    The recipe's size fits now: the first time was a transient, keep the size. The shrunk step is more
    than MISS slower than predicted: plan once more from the new times. Else the plan stands."""
    n, first, seconds = plan
    t = rcfg.train
    again, check = step_s(rcfg), step_s(shrunk(rcfg, n))
    if t.time_budget_s / again >= t.budget_min_steps / HYSTERESIS:
        log(f"host fit: the recipe's size measured {first * 1000:.0f}, then {again * 1000:.0f} ms/step: a "
            "transient, so nothing shrinks")  # fmt: skip
        return 0, again, again
    if check <= MISS * seconds:
        return plan
    log(
        f"host fit: the shrunk step measured {check * 1000:.0f} ms, predicted {seconds * 1000:.0f} (over "
        f"{MISS:g}x off: the load changed); planned again from the recipe's {again * 1000:.0f} ms/step"
    )
    return shrinks_needed(rcfg, step_s, again)


def measure(rcfg: Config, device: torch.device, log: Callable[[str], None]) -> tuple[int, int]:
    """Rank 0's probe: (the shrinks needed, 1 if compiled wins else 0), each logged with its numbers."""
    t, choose_compile = rcfg.train, rcfg.train.compile == "auto"
    ratio, use_compiled, at_size = 1.0, 0, None
    with all_cores():
        if choose_compile:
            try:
                eager, compiled = probe_steps(rcfg, device, with_compiled=True)
            except torch._dynamo.exc.TorchDynamoException as e:  # no C++ compiler, for instance
                eager, compiled = probe_steps(rcfg, device)
                log(f"compile: compiling fails here ({first_line(e, 120)})")
            use_compiled = int(compiled < COMPILE_GAIN * eager)
            ratio = compiled / eager if use_compiled else 1.0
            at_size = compiled if use_compiled else eager
            log(f"compile: {'compiled' if use_compiled else 'eager'} (measured {eager * 1000:.0f} ms eager, "
                f"{compiled * 1000:.0f} ms compiled per step, medians of {REPEATS}+; compiled wins when "
                f"{1 - COMPILE_GAIN:.0%} faster)")  # fmt: skip
        if t.budget_min_steps <= 0:
            return 0, use_compiled
        step_s = lambda c: ratio * probe_steps(c, device)[0]  # noqa: E731
        n, first, seconds = shrinks_needed(rcfg, step_s, at_size)
        if n:
            n, first, seconds = confirm(rcfg, step_s, (n, first, seconds), log)
    mode, budget, least = ("compiled" if use_compiled else "eager"), t.time_budget_s, t.budget_min_steps
    trial = copy.deepcopy(rcfg)
    changes = {str(c).split("=")[0]: str(c) for c in (shrink(trial) for _ in range(n))}  # a key once
    numbers = f"{first * 1000:.0f} ms/step {mode} at the recipe's size: ~{int(budget / first)} steps in "
    numbers += f"{budget:g}s"
    if budget / first >= least / HYSTERESIS:
        log(f"host fit: the recipe's size fits ({numbers}; train.budget_min_steps={least}, shrunk only "
            f"below {least}/{HYSTERESIS:g})")  # fmt: skip
        return 0, use_compiled
    if n:
        log(f"host fit: {', '.join(changes.values())} ({numbers}, fewer than train.budget_min_steps={least}/"
            f"{HYSTERESIS:g}; now {seconds * 1000:.0f} ms/step: ~{int(budget / seconds)} steps)")  # fmt: skip
    if budget / seconds < least and not shrink(trial):
        batch = "global" if "train.global_batch_tokens" in rcfg.fixed else "micro"
        given = sorted({f"train.{batch}_batch_tokens", "model.n_embd"} & rcfg.fixed)  # what kept the size
        why = f"{', '.join(given)} as given" if given else "nothing left to shrink"
        log(f"host fit: kept the size ({why}), though only ~{int(budget / seconds)} of "
            f"train.budget_min_steps={least} steps fit {budget:g}s "
            f"at {seconds * 1000:.0f} ms/step {mode}")  # fmt: skip
    return n, use_compiled


def fit_to_host(
    cfg: Config,
    rcfg: Config,
    device: torch.device,
    is_main: bool,
    agree: Callable[[int], int],
    log: Callable[[str], None],
) -> bool:
    """Choose compile and size for `cfg` (and `rcfg`) from rank 0's probe (`agree` shares its answers), then
    spend the fit (budget_min_steps = 0, compile on/off) so a resume keeps it; whether the size changed."""
    n, use_compiled = measure(rcfg, device, log) if is_main else (0, 0)
    n, use_compiled = agree(n), agree(use_compiled)
    for _ in range(n):
        shrink(cfg)
    r, t = rcfg.train, cfg.train
    r.global_batch_tokens, r.micro_batch_tokens = t.global_batch_tokens, t.micro_batch_tokens
    rcfg.model.n_embd = cfg.model.n_embd  # (rcfg's model may be cfg's own: shrunk once, not twice)
    for c in (t, r):
        c.budget_min_steps = 0
        if c.compile == "auto":
            c.compile = "on" if use_compiled else "off"
    return n > 0
