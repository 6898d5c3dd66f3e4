"""The FLOPs axis of compare, verify and ablate: what a run cost in compute, whatever it ran on.

Training FLOPs are the model's FLOPs per token (GPT.flops_per_token, the count MFU uses, recorded in
summary.json) times the tokens trained; a run from before that was recorded gets the count from its
config.json. Tokens to target are the tokens trained at the first validation at or below the target.
"""

from __future__ import annotations

from speedrun.errors import ConfigError
from speedrun.tools.compare import Run


def flops_per_token(run: Run) -> int | None:
    """The run's recorded count, or the count of the model its config.json describes (None when this
    version cannot read that config)."""
    if run.flops_per_token is not None:
        return run.flops_per_token
    import torch

    from speedrun.config_files import read_run_config
    from speedrun.model.gpt import GPT

    try:
        cfg = read_run_config(run.path)
    except ConfigError:
        return None
    with torch.device("meta"):  # shapes only
        run.flops_per_token = GPT(cfg.model).flops_per_token(cfg.train.seq_len)
    return run.flops_per_token


def train_flops(run: Run) -> float | None:
    """FLOPs per token x tokens trained; None when either is unknown."""
    per_token = flops_per_token(run)
    return None if per_token is None or run.tokens is None else float(per_token) * run.tokens


def tokens_to_target(run: Run, target: float) -> int | None:
    """Tokens trained at the first validation at or below `target`; None when none reached it."""
    return next((tokens for tokens, _, loss in run.curve if loss <= target), None)


def format_flops(value: float | None) -> str:
    """`1.23e15`: three digits, the exponent without its plus sign."""
    return "-" if value is None else f"{value:.2e}".replace("e+", "e")


def cost(runs: list[Run], target: float) -> dict:
    """verify's cost report: the mean training FLOPs of the finished runs, and the mean tokens to the
    target of those that reached it (and how many did)."""
    from speedrun.tools.stats import mean_sd

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
