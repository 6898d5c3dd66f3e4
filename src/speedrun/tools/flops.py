"""The FLOPs axis of compare, verify and ablate: what a run cost in compute, whatever it ran on.

Training FLOPs are Σ over steps of tokens × the count at that step's windows (model/flops.py), recorded in
summary.json as `train_flops`; a run from before that was recorded gets them from its config.json through
its model family (then, if this version cannot read that config, from an old `flops_per_token` × tokens).
Tokens to target are the tokens trained at the first validation at or below the target.
"""

from __future__ import annotations

from speedrun.errors import ConfigError
from speedrun.tools.results import Run
from speedrun.tools.stats import mean_sd


def train_flops(run: Run) -> float | None:
    """The run's training FLOPs; None when neither recorded nor derivable."""
    if run.train_flops is None and run.steps:
        from speedrun.config.files import read_run_config
        from speedrun.train.flops import config_model, run_flops

        try:
            cfg = read_run_config(run.path)
        except ConfigError:
            cfg = None
        if cfg is not None:
            run.train_flops = run_flops(config_model(cfg), cfg, run.steps)
        elif run.flops_per_token is not None and run.tokens is not None:  # the old count, at the last window
            run.train_flops = float(run.flops_per_token) * run.tokens
    return run.train_flops


def flops_per_token(run: Run) -> float | None:
    """The run's mean training FLOPs per token (the FLOPs axis of `compare --plot`)."""
    total = train_flops(run)
    return None if total is None or not run.tokens else total / run.tokens


def tokens_to_target(run: Run, target: float) -> int | None:
    """Tokens trained at the first validation at or below `target`; None when none reached it."""
    return next((tokens for tokens, _, loss in run.curve if loss <= target), None)


def format_flops(value: float | None) -> str:
    """`1.23e15`: three digits, the exponent without its plus sign."""
    return "-" if value is None else f"{value:.2e}".replace("e+", "e")


def cost(runs: list[Run], target: float) -> dict:
    """verify's cost report: the mean training FLOPs of the finished runs, and the mean tokens to the
    target of those that reached it (and how many did)."""
    done = [r for r in runs if r.finished]
    reached = [t for r in done if (t := tokens_to_target(r, target)) is not None]
    return {
        "train_flops_mean": mean_sd([f for r in done if (f := train_flops(r)) is not None])[0],
        "tokens_to_target_mean": mean_sd(reached)[0],
        "reached_target": len(reached),
        "finished": len(done),
    }


def cost_line(report: dict, target: float) -> str:
    tokens = report["tokens_to_target_mean"]
    return (
        f"cost: training FLOPs {format_flops(report['train_flops_mean'])} per run; tokens to {target:g}: "
        + (f"{tokens:,.0f}" if tokens is not None else "-")
        + f" ({report['reached_target']} of {report['finished']} finished runs reached it)"
    )
