"""The CUDA-graph capture plan of a run, computed on the CPU from its stage plan (issue 44; #92 captures
its training step and its optimizer tail by hand).

A captured graph replays fixed shapes and a fixed sequence of kernels, so a run needs one graph per
configuration its steps take: per stage, the batch (tokens per step), the longest document and the
attention windows; and, for the optimizer tail, whether the step is an Adam step (`optim.adam_every`:
Adam runs on every n-th step only). Stages that share a configuration share its graph. Each graph gets
two untimed visits in the warm-up at the first step that has it: the first captures it, the second
replays it and checks it against an eager step. The warm-up restores every state afterwards
(train/warmup.py), so it may visit a step twice; the record rules allow at most 40 warm-up steps.

This module only plans; the capture itself is perf/graphs.py (the step, by hand or as torch.compile's
cudagraph trees) and perf/optimizer_graphs.py (the optimizer tail), which read these visits.
"""

from __future__ import annotations

from dataclasses import dataclass

from speedrun.config.stages import StagePlan
from speedrun.train.stages import stage_at, stage_bounds

MAX_WARMUP_STEPS = 40  # the record rules' untimed warm-up
VISITS = ("capture", "check")  # per graph: capture it, then replay it against an eager step


@dataclass(frozen=True)
class GraphKey:
    """What a graph is specialized on."""

    batch_tokens: int
    max_doc_len: int
    windows: tuple[int, int]  # (short, long) in 128-token blocks
    adam: bool  # the optimizer tail runs Adam (always True when adam_every == 1)


@dataclass(frozen=True)
class CapturePlan:
    keys: tuple[GraphKey, ...]  # in the order the run first meets them
    stages: dict[GraphKey, tuple[int, ...]]  # the stages (0-based, the extension last) each key serves
    visits: tuple[tuple[int, GraphKey, str], ...]  # (step, key, "capture" | "check") in warm-up order

    @property
    def warmup_steps(self) -> int:
        return len(self.visits)

    def describe(self) -> str:
        return (
            f"CUDA graphs: {len(self.keys)} configurations x {len(VISITS)} untimed visits = "
            f"{self.warmup_steps} warm-up steps (the rules allow {MAX_WARMUP_STEPS})"
        )


def key_at(plan: StagePlan, step: int, adam_every: int) -> GraphKey:
    """The configuration of `step` (its stage's batch, document cut, windows; its Adam parity)."""
    s = plan.stages[stage_at(step, plan)[0]]
    return GraphKey(s.batch_tokens, s.max_doc_len, s.windows, step % adam_every == adam_every - 1)


def capture_plan(plan: StagePlan, adam_every: int = 1, limit: int = MAX_WARMUP_STEPS) -> CapturePlan:
    """Every graph key of the run and its visits; ValueError when they need more than `limit` steps."""
    stages: dict[GraphKey, list[int]] = {}
    first: dict[GraphKey, int] = {}
    for i, (start, end) in enumerate(stage_bounds(plan)):
        for step in range(start, min(end, start + adam_every)):  # each Adam parity the stage has
            key = key_at(plan, step, adam_every)
            first.setdefault(key, step)
            if i not in stages.setdefault(key, []):
                stages[key].append(i)
    keys = tuple(first)
    visits = tuple((first[k], k, what) for k in keys for what in VISITS)
    if len(visits) > limit:
        raise ValueError(
            f"CUDA graphs need {len(visits)} warm-up steps ({len(keys)} configurations x {len(VISITS)}), "
            f"more than the {limit} the rules allow"
        )
    return CapturePlan(keys, {k: tuple(v) for k, v in stages.items()}, visits)
