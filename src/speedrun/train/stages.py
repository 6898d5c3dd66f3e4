"""Training stages (records #46 on): the batch, the longest document, the windows, the LR multiplier
and the multi-token-prediction weights change at stage boundaries; extension steps follow the
scheduled ones at the final values. Every value is a pure function of the step (`stage_values`);
`train.stages` writes a plan as text (`parse_stages`, the one owner of its rules), and
train/schedule.schedule_at turns it into the per-step values the loop applies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from speedrun.config import Config
from speedrun.config_types import FP32_MAX, INT64_MAX, MAX_SEQ_LEN
from speedrun.errors import ConfigError
from speedrun.model.attention import BLOCK_SIZE

MAX_BLOCKS = (MAX_SEQ_LEN - 1) // BLOCK_SIZE  # a window is blocks·128 + 1 int32 positions (model/varlen.py)


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
    # int: HEAD's get_lr, from int(N·(1 − frac)) | exact: #26–#45's, x = min(s/N, 0.9999) | fraction:
    # #46–#53's, x = s/N, the floor after N (stage_lr)
    cooldown_form: str = "int"
    # #46–#53: a stage starts at the first step with s/N >= its start fraction (int(3·s/N)), and the MTP
    # weights interpolate in s/N over its nominal fraction; else rounded starts and step-wise weights
    fraction_bounds: bool = False
    split_stage: int = -1  # untie embedding and head at the first odd step of this stage (-1: never)
    val_long_window: int = 0  # long window (blocks) of the final validation; 0 = the last stage's
    val_short_window: int = 0  # short window (blocks) of the final validation; 0 = the last stage's
    val_yarn_window: int = 0  # #35: the final validation's YaRN rescales to this, not to its long window
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


def boundary(acc: float, n: int, fraction: bool) -> int:
    """The step where cumulative fraction `acc` of `n` scheduled steps ends: rounded, or (#46–#53) the
    first step s with s/n >= acc."""
    if not fraction:
        return round(acc * n)
    s = math.ceil(acc * n)
    while s > 0 and (s - 1) / n >= acc:
        s -= 1
    while s / n < acc:
        s += 1
    return s


def stage_bounds(plan: StagePlan) -> list[tuple[int, int]]:
    """[start, end) of every stage: the scheduled ones at their cumulative fractions, then the extension."""
    ends, acc = [0], 0.0
    for stage in plan.stages[:-1]:
        acc += stage.duration
        ends.append(boundary(acc, plan.scheduled_steps, plan.fraction_bounds))
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
    int(N·(1 − frac)) on (HEAD), with `cooldown_form` "fraction" as #46–#53's get_lr (x = s/N, the
    floor after N), or with "exact" as #26–#45's get_lr, x = min(s/N, 0.9999) and
    t = 1 − (1 − x)/frac once x >= 1 − frac (the same where N·(1 − frac) is whole, but for the cap)."""
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


def long_window_history(step: int, plan: StagePlan) -> tuple[int, ...]:
    """The long windows (blocks) the run has gone through up to `step`, in order: what YaRN rescales by
    (#31: once per growth, and once more for the final validation's longer window, or for its YaRN
    window where the plan names one: #35 validates with 20 long blocks but rescales to 13)."""
    i = stage_at(step, plan)[0]
    history = [s.windows[1] for s in plan.stages[: i + 1]]
    final = stage_values(step, plan).long_window
    if step >= plan.total_steps and plan.val_yarn_window:
        final = plan.val_yarn_window
    return (*history, final) if final != history[-1] else tuple(history)


def describe_stages(plan: StagePlan, accumulation: int, world_size: int) -> str:
    """One log line: each stage's steps, tokens (processes x micro-steps x row), document cut, windows."""
    parts = []
    for (start, end), s in zip(stage_bounds(plan), plan.stages, strict=True):
        row = s.batch_tokens // (accumulation * world_size)
        doc = f", docs <= {s.max_doc_len}" if s.max_doc_len else ""
        steps = f"steps {start}-{end - 1}" if end > start else "no steps (ext=0: final validation only)"
        parts.append(
            f"{steps}: {s.batch_tokens:,} tokens ({world_size} x {accumulation} x {row:,})"
            f"{doc}, windows {s.windows[0]}/{s.windows[1]} blocks, lr x{s.lr_mul:g}"
        )
    val = f"; final validation long window {plan.val_long_window}" if plan.val_long_window else ""
    val += f", short {plan.val_short_window}" if plan.val_short_window else ""
    val += f", YaRN to {plan.val_yarn_window}" if plan.val_yarn_window else ""
    return "stages: " + "; ".join(parts) + val


# ---------------------------------------------------------------------------------------------------
# `train.stages`: the stage plan as a recipe writes it, parsed once (the one owner of its rules)


def stage_plan(cfg: Config) -> StagePlan | None:
    """The StagePlan of `train.stages` (None when unset). The cool-down is `train.warmdown_frac` of the
    scheduled steps down to the LR `train.final_lr_frac`; Muon momentum warms up and cools down as the
    optim.muon_momentum_* keys say."""
    t, o = cfg.train, cfg.optim
    if not t.stages.strip():
        return None
    momentum = (
        o.muon_momentum_start,
        o.muon_momentum,
        o.muon_momentum_warmup_steps,
        o.muon_momentum_cooldown_steps,
    )
    return parse_stages(
        t.stages, t.steps, t.warmdown_frac, t.final_lr_frac, momentum, t.cooldown_start,
        t.stage_bounds == "fraction",
    )  # fmt: skip


def _number(key: str, text: str, kind: type, entry: int) -> float:
    try:
        if kind is float and "/" in text:
            a, b = text.split("/", 1)
            value = float(a) / float(b)
        else:
            value = kind(text)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"train.stages: stage {entry + 1}: {key}={text!r} is not a valid number") from None
    if not math.isfinite(value) or value < 0:  # a fraction too (1e400/1e400 is nan, -1/2 negative)
        raise ConfigError(f"train.stages: stage {entry + 1}: {key} must be a finite number >= 0, got {text}")
    limit = FP32_MAX if kind is float else MAX_BLOCKS if key in ("windows", "val") else INT64_MAX
    if value > limit:  # what torch holds: an fp32 LR, int32 positions, int64 counts
        shown = f"{limit:.4g}" if kind is float else f"{limit:,}" + " blocks" * (limit == MAX_BLOCKS)
        raise ConfigError(f"train.stages: stage {entry + 1}: {key} must be at most {shown}, got {text}")
    return value


def _mtp(text: str, entry: int) -> dict[str, tuple[float, ...]]:
    """`mtp=W,W,…` (constant) or `mtp=START>END` (each W,W,…: linear from START to END over the stage)."""
    start, sep, end = text.partition(">")
    ends = [tuple(_number("mtp", w, float, entry) for w in part.split(",")) for part in (start, end or start)]
    if len(ends[0]) != len(ends[1]) or not ends[0]:
        raise ConfigError(
            f"train.stages: stage {entry + 1}: mtp={text!r} must be weights W,W,… or START>END of one length"
        )
    return {"mtp_start": ends[0], "mtp_end": ends[1]}


def _stage(text: str, entry: int, last: bool) -> tuple[Stage, int, tuple[int, int, int]]:
    """One `key=value ...` entry → (Stage, extension steps, the final validation's (long, short, YaRN)
    windows, 0 where not given)."""
    allowed = {"tokens", "doc", "windows", "lr", "mtp", "ext" if last else "frac"} | (
        {"val", "yarn"} if last else set()
    )
    fields: dict[str, str] = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or key not in allowed:
            raise ConfigError(
                f"train.stages: stage {entry + 1}: {item!r} is not key=value with a key of "
                f"{', '.join(sorted(allowed))}"
            )
        if key in fields:  # which one was meant? (the later one silently won)
            raise ConfigError(f"train.stages: stage {entry + 1}: {key} is given twice")
        fields[key] = value
    required = {"tokens", "windows", "ext" if last else "frac"}
    if missing := sorted(required - set(fields)):
        raise ConfigError(f"train.stages: stage {entry + 1} needs {', '.join(missing)}")
    short, sep, long = fields["windows"].partition("/")
    windows = (
        int(_number("windows", short, int, entry)),
        int(_number("windows", long, int, entry)) if sep else -1,
    )
    if not 1 <= windows[0] <= windows[1]:
        raise ConfigError(
            f"train.stages: stage {entry + 1}: windows must be SHORT/LONG blocks with 1 <= SHORT <= LONG, "
            f"got {fields['windows']!r}"
        )
    stage = Stage(
        batch_tokens=int(_number("tokens", fields["tokens"], int, entry)),
        max_doc_len=int(_number("doc", fields.get("doc", "0"), int, entry)),
        windows=windows,
        lr_mul=_number("lr", fields.get("lr", "1"), float, entry),
        duration=0.0 if last else _number("frac", fields["frac"], float, entry),
    )
    if "mtp" in fields:
        stage = dataclasses.replace(stage, **_mtp(fields["mtp"], entry))
    if stage.batch_tokens < 1:
        raise ConfigError(f"train.stages: stage {entry + 1}: tokens must be at least 1")
    ext = int(_number("ext", fields.get("ext", "0"), int, entry))
    val_short, sep, val_long = fields.get("val", "0").rpartition("/")
    val = int(_number("val", val_long, int, entry))
    short_val = int(_number("val", val_short, int, entry)) if sep else 0
    yarn = int(_number("yarn", fields.get("yarn", "0"), int, entry))
    if val and val < windows[1]:
        raise ConfigError(
            f"train.stages: val={val} must not be below the last stage's long window ({windows[1]})"
        )
    if sep and not 1 <= short_val <= val:
        raise ConfigError(f"train.stages: val={fields['val']} must be SHORT/LONG blocks, 1 <= SHORT <= LONG")
    if yarn and not windows[1] <= yarn <= val:
        raise ConfigError(
            f"train.stages: yarn={yarn} (the final validation's YaRN window) must lie between the last "
            f"stage's long window ({windows[1]}) and val ({val or 'not given'})"
        )
    return stage, ext, (val, short_val, yarn)


@functools.cache
def parse_stages(
    text: str,
    steps: int,
    cooldown_frac: float,
    lr_floor: float,
    momentum: tuple[float, float, int, int],
    cooldown_form: str = "int",
    fraction_bounds: bool = False,
) -> StagePlan:
    """`train.stages` → StagePlan; every mistake is one ConfigError naming the stage and the key.

    Stages are separated by `;`. A scheduled stage: `tokens=N` (per optimizer step), `windows=S/L`
    (blocks of 128 tokens), `frac=F` (of the scheduled steps, `1/3` allowed), optional `doc=N` (longest
    document, 0 = no cut), `lr=F` (multiplier, 1) and `mtp=W,W,…` or `mtp=START>END` (#53's
    multi-token-prediction weights, constant or linear over the stage; default 1). The last stage is
    the extension: `ext=N` steps at its values after the scheduled ones (train.steps counts them),
    optional `val=L` long window for the final validation (`val=S/L`: its short and long windows) and
    `yarn=Y`, the window its YaRN rescales to (default: its long window).
    """
    assert cooldown_form in ("int", "exact", "fraction"), f"cooldown_form {cooldown_form!r} (was a bool)"
    entries = [e for e in text.split(";") if e.strip()]
    if len(entries) < 2:
        raise ConfigError("train.stages needs at least one scheduled stage and the extension stage (ext=N)")
    parsed = [_stage(e, i, i == len(entries) - 1) for i, e in enumerate(entries)]
    stages = tuple(p[0] for p in parsed)
    ext, (val, val_short, val_yarn) = parsed[-1][1], parsed[-1][2]
    scheduled = steps - ext
    if scheduled < len(stages) - 1:
        raise ConfigError(
            f"train.stages: ext={ext} leaves {scheduled} of train.steps ({steps}) for "
            f"{len(stages) - 1} stage(s)"
        )
    ends, acc = [0], 0.0
    for i, stage in enumerate(stages[:-1]):
        acc += stage.duration
        ends.append(boundary(acc, scheduled, fraction_bounds))
        if ends[-1] <= ends[-2]:
            raise ConfigError(
                f"train.stages: stage {i + 1} (frac={stage.duration:g}) gets no step of {scheduled}"
            )
    if abs(acc - 1) > 1e-9 or ends[-1] != scheduled:  # the sum, not its rounding to steps (0.97 is no 1)
        raise ConfigError(f"train.stages: the scheduled stages' frac add up to {acc:.10g}, not 1")
    if not 0 < cooldown_frac <= 1:
        raise ConfigError(
            "train.stages needs train.warmdown_frac > 0 (the cool-down's share of the scheduled steps)"
        )
    low, high, warmup, cooldown = momentum
    return StagePlan(
        stages=stages, scheduled_steps=scheduled, extension_steps=ext, cooldown_frac=cooldown_frac,
        lr_floor=lr_floor, cooldown_form=cooldown_form, fraction_bounds=fraction_bounds,
        val_long_window=val, val_short_window=val_short, val_yarn_window=val_yarn,
        momentum_min=low, momentum_max=high,
        momentum_warmup=warmup, momentum_cooldown=cooldown,
    )  # fmt: skip
