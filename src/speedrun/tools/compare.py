"""`speedrun compare`: a table of runs, curves, and the record rules' statistical test.

Everything comes from files inside each run directory (`config.json`, `metrics.jsonl`, and
`summary.json` when present), never from absolute paths, so runs copied from other machines compare.
Runs whose configs are equal except for the seed and settings that only observe a run (logging,
validation and checkpoint cadence, device, compile, data folder location) form a group: the record
rules ask whether the group's mean final val loss is below the target, by a one-sided t-test.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

from speedrun.atomic import write_atomic
from speedrun.config.files import FIXED, RESUMABLE_CHANGES, RUN_ID
from speedrun.errors import DataError
from speedrun.tools.alike import LOSS_FACTS, SPEED_FACTS, differences, setting
from speedrun.tools.flops import flops_per_token, format_flops, tokens_to_target, train_flops
from speedrun.tools.results import Run, columns, fmt, run_names
from speedrun.tools.stats import below_target_test, mean_sd, research_module

#: Keys that may differ inside a group of repeats.
NOT_COMPARED = ("train.seed", "data.dir", RUN_ID, FIXED, *RESUMABLE_CHANGES)


def group_key(run: Run) -> tuple:
    return tuple(sorted((k, json.dumps(v)) for k, v in run.config.items() if k not in NOT_COMPARED))


@dataclass
class Group:
    label: str
    runs: list[Run]
    mean: float | None = None
    std: float | None = None
    t: float | None = None
    p: float | None = None

    @property
    def n(self) -> int:
        return len(self.losses)

    @property
    def losses(self) -> list[float]:
        """Final val losses of the runs that finished: a stopped or killed run's last loss is not a result."""
        return [r.final_val_loss for r in self.runs if r.finished and r.final_val_loss is not None]

    @property
    def unfinished(self) -> int:
        return sum(not r.finished for r in self.runs)


def make_groups(runs: list[Run], target: float) -> list[Group]:
    """Runs grouped by config (seed and observation settings ignored), with mean, std, n, t-test."""

    facts = {id(run): setting(run.path) for run in runs}  # runs on other data or in another precision are
    known = [
        k for k in LOSS_FACTS if all(f[k] is not None for f in facts.values())
    ]  # another group (alike.py); the source where some run lacks the content's fingerprint (issue 46)
    if "data content" in known and "data" in known:
        known.remove("data")
    by_key: dict[tuple, list[Run]] = {}
    for run in runs:  # a fact some run does not record (an older run) cannot set runs apart
        alike = tuple((f"run {k}", json.dumps(facts[id(run)][k])) for k in known)
        by_key.setdefault(group_key(run) + alike, []).append(run)
    groups = []
    for members in by_key.values():
        same_recipe = [k for k in by_key if dict(k).get("recipe") == json.dumps(members[0].recipe)]
        label = members[0].recipe
        if len(same_recipe) > 1:  # name the settings that set this group apart from its namesakes
            mine = dict(next(k for k, v in by_key.items() if v is members))
            others = [dict(k) for k in same_recipe if dict(k) != mine]
            diff = sorted({k for o in others for k in set(mine) | set(o) if mine.get(k) != o.get(k)})
            label += " [" + ", ".join(f"{k}={json.loads(mine[k]) if k in mine else '-'}" for k in diff) + "]"
        g = Group(label, members)
        g.mean, g.std = mean_sd(g.losses)
        if g.std is not None:
            g.t, g.p = below_target_test(g.losses, target)
        groups.append(g)
    return groups


def format_table(runs: list[Run], groups: list[Group], target: float) -> str:
    """The runs table (with the FLOPs axis: training FLOPs, tokens to reach the target), then one line
    per group with its statistics."""

    names = run_names(runs)
    header = ("run", "recipe", "seed", "steps", "train time", "tokens/s", "val loss", "val bpb", "FLOPs")
    header += (f"tokens to {target:g}",)
    rows = [
        (
            name if r.finished else f"{name} ({r.status})",
            r.recipe,
            fmt(r.seed, "d"),
            fmt(r.steps, "d"),
            fmt(r.train_time_s, ".1f", "s"),
            fmt(r.tokens_per_s, ",.0f"),
            fmt(r.final_val_loss, ".4f"),
            fmt(r.final_val_bpb, ".4f"),
            format_flops(train_flops(r)),
            fmt(tokens_to_target(r, target), ",d"),
        )
        for name, r in zip(names, runs, strict=True)
    ]
    lines = [columns([header, *rows]), ""]

    for g in groups:
        for text in differences({str(r.path): setting(r.path) for r in g.runs}, SPEED_FACTS):
            lines.append(f"note: group {g.label}'s runs differ in {text}: their times do not compare")
        stats = f"n={g.n}  mean {fmt(g.mean, '.4f')}  std {fmt(g.std, '.4f')}"
        if g.p is not None:
            verdict = "below" if g.p < 0.01 else "not shown below"
            stats += f"  t={g.t:.3f}  p={g.p:.3g} (mean < {target}: {verdict} at p<0.01)"
        else:
            stats += "  (t-test needs >= 2 finished runs with a final val loss)"
        if g.unfinished:
            stats += f"  ({g.unfinished} unfinished run(s) left out)"
        lines.append(f"group {g.label}: {stats}")
    return "\n".join(lines)


def plot_runs(runs: list[Run], out: Path, target: float | None = None, x: str = "tokens") -> Path:
    """PNG with val loss against tokens (or training FLOPs: `x="flops"`, which compares runs across
    hardware) and against training time, one line per run (written atomically)."""

    scale = {id(r): 1 if x == "tokens" else flops_per_token(r) for r in runs}
    unknown = [r.path for r in runs if scale[id(r)] is None]
    if unknown:
        raise DataError(f"{unknown[0]}: FLOPs per token unknown (a config.json this version cannot read)")
    research_module("matplotlib", "compare --plot").use("Agg")
    plt = research_module("matplotlib.pyplot", "compare --plot")

    fig, (ax_tok, ax_time) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80)
    for name, run in zip(run_names(runs), runs, strict=True):
        if not run.curve:
            continue
        tokens, times, losses = zip(*run.curve, strict=True)
        ax_tok.plot([t * scale[id(run)] for t in tokens], losses, marker=".", label=name)
        ax_time.plot(times, losses, marker=".", label=name)
    first = "tokens" if x == "tokens" else "training FLOPs"
    for ax, xlabel in ((ax_tok, first), (ax_time, "training time (s)")):
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss")
        ax.grid(alpha=0.3)
    ax_tok.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    write_atomic(Path(out), buf.getvalue())
    return Path(out)
