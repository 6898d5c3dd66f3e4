"""The stage plan as a recipe writes it (`train.stages`, records #46 on), parsed and checked once,
torch-free: `parse_stages` owns the plan text's rules, `check_stages` what a plan needs of (and forbids
in) the rest of the config; train/stages.py turns a StagePlan into every step's values."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from speedrun.config import Config, DataConfig, TrainConfig
from speedrun.config.families import model_facts
from speedrun.config.types import BLOCK_SIZE, FP32_MAX, INT64_MAX, MAX_SEQ_LEN
from speedrun.errors import ConfigError

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
    prefix: tuple[float, float] | None = None  # #88's prefix-loss weight at the stage's start and end
    # #92's candidate counts P of the sampled softmax: the stage's steps in equal parts, one count each
    # (the record's CANDIDATES_BY_STAGE); () runs the full softmax
    sampled: tuple[int, ...] = ()
    prefix_steps: tuple[float, ...] = ()  # #92's stepped prefix-loss weights: the stage in equal parts
    grow: int = 0  # #92: steps added to this stage after the fractions are laid over the other steps
    segment: int = 0  # #92: attention segments of at most this many tokens (0 = a document is one)


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

    @property
    def grown_steps(self) -> int:
        return sum(s.grow for s in self.stages)


def scheduled_ends(plan: StagePlan) -> list[int]:
    """[0, end of each scheduled stage]: the cumulative fractions over the scheduled steps less the grown
    ones, then every end from a growing stage's on moved by its growth (#92: 52 steps into stage 3, its
    later boundaries keep their place relative to the end; the cool-down spans all scheduled steps)."""
    base, ends, acc, grown = plan.scheduled_steps - plan.grown_steps, [0], 0.0, 0
    for stage in plan.stages[:-1]:
        acc += stage.duration
        grown += stage.grow
        ends.append(boundary(acc, base, plan.fraction_bounds) + grown)
    return ends


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


def stage_plan(cfg: Config) -> StagePlan | None:
    """The StagePlan of `train.stages` (None when unset): cool-down `train.warmdown_frac` of the scheduled
    steps down to `train.final_lr_frac`, Muon momentum as the optim.muon_momentum_* keys say."""
    t, o = cfg.train, cfg.optim
    if not t.stages.strip():
        return None
    return parse_stages(
        t.stages, t.steps, cooldown_frac=t.warmdown_frac, lr_floor=t.final_lr_frac,
        cooldown_form=t.cooldown_start, fraction_bounds=t.stage_bounds == "fraction",
        momentum_min=o.muon_momentum_start, momentum_max=o.muon_momentum,
        momentum_warmup=o.muon_momentum_warmup_steps, momentum_cooldown=o.muon_momentum_cooldown_steps,
    )  # fmt: skip


def _number(key: str, text: str, kind: type, entry: int) -> float:
    try:
        a, sep, b = text.partition("/")  # a float may be a fraction (frac=1/3)
        value = float(a) / float(b) if kind is float and sep else kind(text)
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


def _blocks(key: str, text: str, entry: int) -> tuple[int, int]:
    """Windows in blocks: `S/L` → (S, L) with 1 <= S <= L, `L` alone → (0, L) (not for `windows`)."""
    short, sep, long = text.rpartition("/")
    pair = int(_number(key, short, int, entry)) if sep else 0, int(_number(key, long, int, entry))
    if (sep or key == "windows") and not 1 <= pair[0] <= pair[1]:
        raise ConfigError(
            f"train.stages: stage {entry + 1}: {key}={text} must be SHORT/LONG blocks, 1 <= SHORT <= LONG"
        )
    return pair


def _stage(text: str, entry: int, last: bool) -> tuple[Stage, int, dict[str, int]]:
    """One `key=value ...` entry → (Stage, extension steps, the final validation's long, short and YaRN
    windows as StagePlan fields, 0 where not given)."""
    allowed = {"tokens", "doc", "windows", "lr", "mtp", "prefix", "sampled", "segment"} | (
        {"ext", "val", "yarn"} if last else {"frac", "grow"}
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
    windows = _blocks("windows", fields["windows"], entry)
    weights: dict[str, tuple[float, ...]] = _mtp(fields["mtp"], entry) if "mtp" in fields else {}
    if "prefix" in fields and "," in fields["prefix"]:  # #92: prefix=W,W,... (the stage in equal parts)
        weights["prefix_steps"] = tuple(
            _number("prefix", w, float, entry) for w in fields["prefix"].split(",")
        )
    elif "prefix" in fields:  # #88: prefix=W or prefix=START>END (linear over the stage, as mtp)
        start, _, end = fields["prefix"].partition(">")
        weights["prefix"] = tuple(_number("prefix", w, float, entry) for w in (start, end or start))
    if "sampled" in fields:  # #92: sampled=P or sampled=P,P,... (the stage in equal parts)
        counts = tuple(int(_number("sampled", p, int, entry)) for p in fields["sampled"].split(","))
        if not all(counts):
            raise ConfigError(
                f"train.stages: stage {entry + 1}: sampled= candidate counts must be at least 1"
            )
        weights["sampled"] = counts
    stage = Stage(
        batch_tokens=int(_number("tokens", fields["tokens"], int, entry)),
        max_doc_len=int(_number("doc", fields.get("doc", "0"), int, entry)),
        windows=windows,
        lr_mul=_number("lr", fields.get("lr", "1"), float, entry),
        duration=0.0 if last else _number("frac", fields["frac"], float, entry),
        grow=int(_number("grow", fields.get("grow", "0"), int, entry)),
        segment=int(_number("segment", fields.get("segment", "0"), int, entry)),
        **weights,
    )
    if stage.batch_tokens < 1:
        raise ConfigError(f"train.stages: stage {entry + 1}: tokens must be at least 1")
    if "segment" in fields and not 0 < stage.segment < (stage.max_doc_len or INT64_MAX):
        raise ConfigError(
            f"train.stages: stage {entry + 1}: segment={stage.segment} must be at least 1 and below doc= "
            f"({stage.max_doc_len}), or it cuts nothing"
        )
    ext = int(_number("ext", fields.get("ext", "0"), int, entry))
    short_val, val = _blocks("val", fields.get("val", "0"), entry)
    yarn = int(_number("yarn", fields.get("yarn", "0"), int, entry))
    if val and val < windows[1]:
        raise ConfigError(
            f"train.stages: val={val} must not be below the last stage's long window ({windows[1]})"
        )
    if yarn and not yarn <= max(val, windows[1]):
        raise ConfigError(
            f"train.stages: yarn={yarn} (the window YaRN rescales to at most) must not exceed the final "
            f"validation's long window ({max(val, windows[1])})"
        )
    return stage, ext, {"val_long_window": val, "val_short_window": short_val, "val_yarn_window": yarn}


@functools.cache
def parse_stages(text: str, steps: int, **constants: Any) -> StagePlan:
    """`train.stages` → StagePlan; every mistake is one ConfigError naming the stage and the key.

    Stages are separated by `;`. A scheduled stage: `tokens=N` (per step), `windows=S/L` (128-token
    blocks), `frac=F` (of the scheduled steps, `1/3` allowed), optional `doc=N` (longest document, 0 = no
    cut), `lr=F` (1), `mtp=W,W,…` or `mtp=START>END` (#53's weights; 1), `prefix=` (#88, as mtp; #92's
    `prefix=W,W,…`: stepped, the stage in equal parts), `sampled=P[,P…]` (#92's candidate counts, the
    stage's steps in equal parts; none: full softmax), `segment=N` (#92: documents attend in segments of
    at most N tokens, the token stream untouched) and `grow=N` (#92: N steps added to the stage after the
    fractions are laid over the other scheduled steps). The last stage is the extension: `ext=N` steps
    (counted in train.steps), optional `val=L` or `val=S/L` (the final validation's windows) and `yarn=Y`
    (the window its YaRN rescales to, which also caps the stages': the medium record's 13). `constants`:
    the plan's other fields, from the rest of the config (StagePlan's defaults for those not given)."""
    entries = [e for e in text.split(";") if e.strip()]
    if len(entries) < 2:
        raise ConfigError("train.stages needs at least one scheduled stage and the extension stage (ext=N)")
    parsed = [_stage(e, i, i == len(entries) - 1) for i, e in enumerate(entries)]
    stages = tuple(p[0] for p in parsed)
    ext = parsed[-1][1]
    scheduled = steps - ext
    plan = StagePlan(stages, scheduled, ext, **parsed[-1][2], **constants)
    assert plan.cooldown_form in ("int", "exact", "fraction"), f"cooldown_form {plan.cooldown_form!r}"
    base = scheduled - plan.grown_steps
    if base < len(stages) - 1:
        raise ConfigError(
            f"train.stages: ext={ext} and grow={plan.grown_steps} leave {base} of train.steps ({steps}) for "
            f"{len(stages) - 1} stage(s)"
        )
    if plan.grown_steps and plan.fraction_bounds:
        raise ConfigError("train.stages: grow= needs train.stage_bounds=round (#92 rounds its boundaries)")
    ends, acc = scheduled_ends(plan), sum(s.duration for s in stages[:-1])
    for i, stage in enumerate(stages[:-1]):
        if ends[i + 1] - stage.grow <= ends[i]:
            raise ConfigError(f"train.stages: stage {i + 1} (frac={stage.duration:g}) gets no step of {base}")
    if abs(acc - 1) > 1e-9 or ends[-1] != scheduled:  # the sum, not its rounding to steps (0.97 is no 1)
        raise ConfigError(f"train.stages: the scheduled stages' frac add up to {acc:.10g}, not 1")
    if not 0 < plan.cooldown_frac <= 1:
        raise ConfigError(
            "train.stages needs train.warmdown_frac > 0 (the cool-down's share of the scheduled steps)"
        )
    return plan


# ---------------------------------------------------------------------------------------------------
# What a plan needs of the rest of the config, and what it makes unable to act (issue 27)


def check_stages(cfg: Config) -> None:
    """What train.stages, model.attention=varlen and model.yarn need of the rest (issue 20); a value the
    plan overrides or leaves without effect is refused when the user gave it, never ignored (issue 27)."""
    m, t, d, f = cfg.model, cfg.train, cfg.data, model_facts(cfg.model)
    staged = bool(t.stages.strip())  # blank is unset, as stage_plan reads it
    if m.attention == "varlen":
        if d.loader != "documents":
            raise ConfigError("model.attention=varlen needs data.loader=documents (it brings cu_seqlens)")
        if f.window_warmup != "none" or f.window_granularity != "token" or f.window_block_list:
            raise ConfigError(
                "model.attention=varlen takes fixed token windows (model.window_warmup=none, "
                "window_granularity=token, window_block_list=false); train.stages changes them per stage"
            )
    if f.yarn and not (staged and f.rope_half_truncated and f.rope_precision in ("auto", "fp32", "bf16")):
        raise ConfigError(
            "model.attn.yarn needs train.stages (the windows it follows) and model.rope_half_truncated=true "
            "with model.attn.rope_precision auto, fp32 or bf16 (#32: tables rounded to bf16)"
        )
    if f.yarn and f.attn_scale <= 0:
        raise ConfigError(
            "model.attn.yarn needs model.attn.scale > 0 (the scale it starts from; the records: 0.1)"
        )
    if not staged:
        if f.sampled_stride:
            raise ConfigError(
                "model.head.sampled_stride takes its candidate counts from train.stages (sampled=): it needs "
                "train.stages"
            )
        if f.mtp > 1:
            raise ConfigError(
                "model.head.mtp takes its weights from train.stages (mtp=): it needs train.stages"
            )
        return
    plan = stage_plan(cfg)  # every mistake in the text itself is a ConfigError naming it
    assert plan is not None
    weights = max(len(s.mtp_start) for s in plan.stages)
    if weights > max(1, f.mtp):
        raise ConfigError(
            f"train.stages weighs {weights} predicted tokens (mtp=): model.head.mtp must be at least "
            f"{weights}"
        )
    if m.attention != "varlen":
        raise ConfigError(
            "train.stages needs model.attention=varlen (stage windows are varlen windows: gpt2026)"
        )
    if f.window or t.warmup_steps or t.warmdown_steps or t.time_budget_s or t.schedule != "trapezoid":
        raise ConfigError(
            "train.stages sets the windows and the LR itself: model.attn.window, train.warmup_steps, "
            "train.warmdown_steps and train.time_budget_s must be 0 and train.schedule trapezoid "
            "(the cool-down is train.warmdown_frac to train.final_lr_frac)"
        )
    # what the plan would silently override or leave without effect (issue 27)
    if d.max_doc_len != DataConfig().max_doc_len:  # a recipe's or the user's
        raise ConfigError(
            f"data.max_doc_len ({d.max_doc_len}) has no effect under train.stages: each stage's doc=N "
            "sets the longest document"
        )
    if plan.val_yarn_window and not f.yarn:
        raise ConfigError(
            f"train.stages: yarn={plan.val_yarn_window} rescales YaRN for the final validation: it needs "
            "model.attn.yarn=true"
        )
    for i, s in enumerate(plan.stages):
        if f.mtp <= 1 and (s.mtp_start, s.mtp_end) != ((1.0,), (1.0,)):
            raise ConfigError(
                f"train.stages: stage {i + 1}: mtp= weighs predicted tokens only with model.head.mtp >= 2 "
                f"(model.head.mtp is {f.mtp})"
            )
        if not any(s.mtp_start) or not any(s.mtp_end):
            raise ConfigError(
                f"train.stages: stage {i + 1}: mtp= weights must not all be 0 (the loss would be 0 and "
                "nothing would learn)"
            )
    _check_sampled(cfg, plan)
    tokens = sorted({s.batch_tokens for s in plan.stages})
    batch = t.global_batch_tokens
    if batch != TrainConfig().global_batch_tokens and batch not in tokens:
        raise ConfigError(
            f"train.global_batch_tokens ({batch:,}) is no step's batch under train.stages (tokens per step: "
            f"{', '.join(f'{n:,}' for n in tokens)}): give one of them, which train.micro_batch_tokens "
            "divides into a step's rows"
        )
    rows = t.document_rows
    if d.doc_rule == "stream" and any(s.max_doc_len for s in plan.stages):
        raise ConfigError("train.stages: doc=N cuts documents only with data.doc_rule=packed (#29 on)")
    for i, stage in enumerate(plan.stages):
        if stage.batch_tokens % rows or stage.batch_tokens // rows > m.max_seq_len:
            raise ConfigError(
                f"train.stages: stage {i + 1}: tokens={stage.batch_tokens} must split into {rows} rows "
                f"of a step (train.global_batch_tokens / train.micro_batch_tokens) of at most "
                f"model.max_seq_len ({m.max_seq_len}) tokens"
            )


def _check_sampled(cfg: Config, plan: StagePlan) -> None:
    """#92's sampled softmax: a stage's sampled= needs model.head.sampled_stride, the stride needs a stage
    that samples, and a count P is at most the vocabulary (it holds every target of a micro-batch, which
    only the run can count: the model refuses a micro-batch with more distinct targets than P)."""
    stride = model_facts(cfg.model).sampled_stride
    counts = [(i, p) for i, s in enumerate(plan.stages) for p in s.sampled]
    if counts and not stride:
        raise ConfigError(
            f"train.stages: stage {counts[0][0] + 1}: sampled= needs model.head.sampled_stride (#92: 20011), "
            "the sweep its negatives come from"
        )
    if stride and not counts:
        raise ConfigError(
            "model.head.sampled_stride has no effect: no stage of train.stages samples (sampled=P)"
        )
    vocab = cfg.model.vocab_size
    for i, p in counts:
        if p > vocab:
            raise ConfigError(
                f"train.stages: stage {i + 1}: sampled={p} exceeds model.vocab_size ({vocab}): run that "
                "stage on the full softmax (no sampled=)"
            )
