"""Training stages (records #46 on) as pure functions of the step (`stage_values`): batch, longest
document, windows, LR multiplier and MTP weights per stage, then extension steps at the final values.
The plan itself is config/stages.py's."""

from __future__ import annotations

from dataclasses import dataclass

from speedrun.config.stages import Stage, StagePlan, scheduled_ends


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
    prefix_weight: float | None = None  # #88; None: the stage sets none (the model keeps its own)
    candidates: int = 0  # #92's sampled softmax: P classes in the training loss; 0: the full softmax
    sweep_start: int = 0  # where this step's negatives start in the endless sweep (sweep_position)
    segment: int = 0  # #92: the longest attention segment (tokens; 0 = whole documents)

    @property
    def attention_len(self) -> int:
        """The longest stretch a training query attends within (FA3's max_seqlen; 0 = the row): the
        document cut, or under it #92's attention segment (its min(train_max_seq_len, VIRTUAL_SEQ_CAP))."""
        if not self.segment:
            return self.max_doc_len
        return min(self.max_doc_len, self.segment) if self.max_doc_len else self.segment


def stage_bounds(plan: StagePlan) -> list[tuple[int, int]]:
    """[start, end) of every stage: the scheduled ones at their cumulative fractions (and growth), then the
    extension."""
    ends = scheduled_ends(plan)
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
    """The stage's multiplier, mixed linearly into `lr_floor` over the cool-down: from step
    int(N·(1 − frac)) (HEAD), x = s/N with the floor after N ("fraction", #46–#53), or
    x = min(s/N, 0.9999) ("exact", #26–#45)."""
    lr = plan.stages[stage_at(step, plan)[0]].lr_mul
    n = plan.scheduled_steps
    if plan.cooldown_form == "fraction":  # #46–#53's get_lr
        x = step / n
        if step > n:
            return plan.lr_floor
        if x < 1 - plan.cooldown_frac:
            return lr
        w = (1 - x) / plan.cooldown_frac
        return lr * w + (1 - w) * plan.lr_floor
    if plan.cooldown_form == "exact":
        x = min(0.9999, step / n)
        if x < 1 - plan.cooldown_frac:
            return lr
        w = (1 - x) / plan.cooldown_frac
        return lr * w + plan.lr_floor * (1 - w)
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


def stage_values(step: int, plan: StagePlan) -> StageValues:
    """Everything the stage plan sets for `step`; `step == total_steps` is the final validation."""
    i, t = stage_at(step, plan)
    s = plan.stages[i]
    short, long = s.windows
    mtp_t = t
    if plan.fraction_bounds and i < len(plan.stages) - 1:  # #53: in x = s/N over the nominal fraction
        mtp_t = (step / plan.scheduled_steps - sum(p.duration for p in plan.stages[:i])) / s.duration
    if step >= plan.total_steps:
        short, long = plan.val_short_window or short, plan.val_long_window or long
    return StageValues(
        stage=i,
        batch_tokens=s.batch_tokens,
        max_doc_len=s.max_doc_len,
        short_window=short,
        long_window=long,
        lr=stage_lr(step, plan),
        muon_momentum=momentum_warmup_cooldown(step, plan),
        mtp_weights=tuple(a + (b - a) * mtp_t for a, b in zip(s.mtp_start, s.mtp_end, strict=True)),
        prefix_weight=prefix_at(s, t, mtp_t),
        candidates=candidates_at(step, plan),
        sweep_start=sweep_position(step, plan),
        segment=s.segment,
    )


def prefix_at(s: Stage, t: float, mtp_t: float) -> float | None:
    """#88's prefix weight, linear as the MTP weights, or #92's stepped parts: part min(n − 1, int(t·n))."""
    if s.prefix_steps:
        return s.prefix_steps[min(len(s.prefix_steps) - 1, int(t * len(s.prefix_steps)))]
    return s.prefix[0] + (s.prefix[1] - s.prefix[0]) * mtp_t if s.prefix else None


# #92's candidate counts (record #92, 2026-08-30, PR #360): a stage's `sampled=` counts split its steps
# into equal parts, part j holding the steps with (s − start)·n // (end − start) = j (the record's
# candidate_count_at); with #92's plan, 10,240 through stages 1 and 2, then 14,336, 14,336, 24,576 over
# the thirds of stage 3, the full softmax from the taper on.


def _parts(plan: StagePlan) -> list[tuple[int, int, int]]:
    """(first step, end, P) of every part of every stage that samples, in step order."""
    parts = []
    for (start, end), s in zip(stage_bounds(plan), plan.stages, strict=True):
        n, span = len(s.sampled), end - start
        for j, p in enumerate(s.sampled):  # steps with (step - start)·n // span == j
            lo, hi = start + -(-j * span // n), start + -(-(j + 1) * span // n)
            if hi > lo:
                parts.append((lo, hi, p))
    return parts


def candidates_at(step: int, plan: StagePlan) -> int:
    """P at `step` (0: the full softmax, always so at the final validation, step >= total_steps)."""
    return next((p for lo, hi, p in _parts(plan) if lo <= step < hi), 0)


def candidate_changes(plan: StagePlan) -> list[int]:
    """Steps (> 0) whose P differs from the step before: each P is a graph of its own (warm-up runs it)."""
    edges = sorted({e for lo, hi, _ in _parts(plan) for e in (lo, hi) if 0 < e < plan.total_steps})
    return [e for e in edges if candidates_at(e, plan) != candidates_at(e - 1, plan)]


def sweep_position(step: int, plan: StagePlan) -> int:
    """Σ P over the steps before `step`: each step's negatives start in the sweep where the previous
    step's P ended (the record's cursor moves by what its host build drew, which depends on the batch;
    this depends on the step alone, so a resume and any process count see the same sets)."""
    return sum(p * max(0, min(step, hi) - lo) for lo, hi, p in _parts(plan))


def long_window_history(step: int, plan: StagePlan) -> tuple[int, ...]:
    """The long windows (blocks) the run has gone through up to `step`: what YaRN rescales by (#31), plus
    the final validation's longer window, or its YaRN window where named (#35: 20 blocks, rescaled to 13).
    The YaRN window also caps the stages' (the medium record rescales up to 13 while windows grow to 23)."""
    i = stage_at(step, plan)[0]
    cap = plan.val_yarn_window or max(s.windows[1] for s in plan.stages)
    history = [min(s.windows[1], cap) for s in plan.stages[: i + 1]]
    final = stage_values(step, plan).long_window
    if step >= plan.total_steps and plan.val_yarn_window:
        final = plan.val_yarn_window
    history.append(min(final, cap))
    return tuple(w for j, w in enumerate(history) if j == 0 or w != history[j - 1])


def short_window_history(step: int, plan: StagePlan) -> tuple[int, ...]:
    """The short windows (blocks) the run has gone through up to `step`: what #92's narrow layers' YaRN
    follows (its narrow rotary tables rescale with the short window; the final validation changes only
    the long one)."""
    i = stage_at(step, plan)[0]
    history = [s.windows[0] for s in plan.stages[: i + 1]]
    return tuple(w for j, w in enumerate(history) if j == 0 or w != history[j - 1])


def describe_stages(plan: StagePlan, accumulation: int, world_size: int) -> str:
    """One log line: each stage's steps, tokens (processes x micro-steps x row), document cut, windows."""
    parts = []
    for (start, end), s in zip(stage_bounds(plan), plan.stages, strict=True):
        row = s.batch_tokens // (accumulation * world_size)
        doc = f", docs <= {s.max_doc_len}" if s.max_doc_len else ""
        doc += f", attention segments <= {s.segment}" if s.segment else ""
        doc += f" ({s.grow} steps grown)" if s.grow else ""
        steps = f"steps {start}-{end - 1}" if end > start else "no steps (ext=0: final validation only)"
        sampled = f", sampled softmax P {','.join(map(str, s.sampled))}" if s.sampled else ""  # #92
        parts.append(
            f"{steps}: {s.batch_tokens:,} tokens ({world_size} x {accumulation} x {row:,})"
            f"{doc}, windows {s.windows[0]}/{s.windows[1]} blocks, lr x{s.lr_mul:g}{sampled}"
        )
    val = f"; final validation long window {plan.val_long_window}" if plan.val_long_window else ""
    val += f", short {plan.val_short_window}" if plan.val_short_window else ""
    val += f", YaRN to {plan.val_yarn_window}" if plan.val_yarn_window else ""
    return "stages: " + "; ".join(parts) + val
