"""`speedrun noise`: how much of a run's val loss is the seed, and how much the machine?

K seeds, each trained R times. Repeats of one seed differ only by nondeterminism (kernels that sum in
another order each time); different seeds differ also by initialisation and data order. The report
gives both spreads (a one-way analysis of variance with the seeds as groups), and from the spread of
one run at a fresh seed, how many runs per arm a t-test needs to show a given effect at p < 0.01.
Repeats of one seed are not independent runs (`verify` refuses them): this is the command for them.

Runs go into `OUT/seed<S>-repeat<R>-<hash>` and are reused or resumed like ablate's.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from speedrun.errors import ConfigError, DataError

ALPHA, POWER = 0.01, 0.8
NEEDS_SEEDS = "n/a (needs 2 seeds)"  # what an estimate from one seed says


def plan(args: argparse.Namespace):
    """One ablate Arm per seed holding its R repeats, every config resolved before anything trains."""
    from speedrun.recipes import load_recipe
    from speedrun.tools.ablate import Arm, config_hash, parse_seed_count

    if args.effect is not None and not (math.isfinite(args.effect) and args.effect > 0):
        raise ConfigError(f"--effect must be a positive val loss difference, got {args.effect}")
    if any(s.partition("=")[0].strip() == "train.seed" for s in args.set):
        raise ConfigError("noise sets train.seed from --seeds; drop the train.seed= override")
    seeds = parse_seed_count(args.seeds)
    arms = []
    for seed in seeds:
        cfg = load_recipe(args.recipe, [*args.set, f"train.seed={seed}"])
        if cfg.train.time_budget_s > 0:
            raise ConfigError(
                f"noise repeats one computation, but {cfg.recipe} has train.time_budget_s="
                f"{cfg.train.time_budget_s:g} (repeats could train different step counts): add --set "
                "train.time_budget_s=0 --set train.budget_min_steps=0"
            )
        out = args.out if args.out is not None else Path("runs") / f"noise-{cfg.recipe}"
        folders = [out / f"seed{seed}-repeat{r}-{config_hash(cfg)}" for r in range(1, args.repeats + 1)]
        arms.append(Arm("noise", None, [(cfg, f) for f in folders]))
    return arms


def _needed(effect: float, sd: float) -> str:
    from speedrun.tools.stats import runs_needed

    n = runs_needed(effect, sd, ALPHA, POWER)
    return "more than 100,000" if n is None else str(n)


def report(arms, effect: float | None) -> str:
    """Per seed its repeats; then the within-seed and between-seed spreads and the runs an effect needs."""
    from speedrun.tools.results import load_run
    from speedrun.tools.stats import mean_sd, noise_components

    groups = []
    lines = [f"{'seed':<5} {'val loss of each repeat':<31} {'mean':<7} sd"]
    for arm in arms:
        runs = [load_run(folder) for _, folder in arm.runs]
        losses = [r.final_val_loss for r in runs if r.finished and r.final_val_loss is not None]
        if len(losses) < len(runs):
            missing = next(r.path for r in runs if not r.finished or r.final_val_loss is None)
            raise DataError(f"{missing}: no final val loss; remove it to train it again")
        groups.append(losses)
        mean, sd = mean_sd(losses)
        each = " ".join(f"{x:.4f}" for x in losses)
        lines.append(f"{arm.runs[0][0].train.seed:<5} {each:<31} {mean:.4f}  {sd:.4f}")
    from speedrun.tools import compile_cache

    folders = [folder for arm in arms for _, folder in arm.runs]
    caches = compile_cache.recorded(folders)  # the losses do not depend on it: a note
    n = noise_components(groups)
    lines.append(compile_cache.summary_line(caches, compile_cache.refuse_mixed(caches, "noise", True)))
    lines.append(f"within-seed sd (nondeterminism, repeats of one seed): {n.within_sd:.4f}")
    if n.seed_means_sd is None:  # one seed: the seed's share cannot be told from one mean
        lines += [
            f"between-seed sd (what the seed adds): {NEEDS_SEEDS}",
            f"one run at a fresh seed: sd {NEEDS_SEEDS}",
        ]
        return "\n".join(lines)
    lines += [
        f"between-seed sd (what the seed adds): {n.between_sd:.4f}; "
        f"sd of the seed means {n.seed_means_sd:.4f}",
        f"one run at a fresh seed: sd {n.total_sd:.4f}",
    ]
    if n.total_sd > 0:
        if n.within_sd == 0:
            lines.append("repeats of a seed gave identical losses: this machine trains deterministically")
        elif n.between_sd > 0:
            lines.append(
                f"repeats of one seed spread {n.total_sd / n.within_sd:.1f}x less than fresh seeds: a test "
                "over repeats would overstate the evidence; give every run its own seed"
            )
        effects = [(n.total_sd, "1 sd"), (2 * n.total_sd, "2 sd")] + (
            [(effect, "--effect")] if effect else []
        )
        lines.append(
            f"runs per arm to show a val loss difference at p < {ALPHA} (two-sided two-sample t-test, "
            f"{POWER:.0%} power, sd {n.total_sd:.4f} per run):"
        )
        lines += [f"  {d:.4f} ({why}): {_needed(d, n.total_sd)}" for d, why in effects]
    return "\n".join(lines)


def cmd_noise(args: argparse.Namespace) -> int:
    from speedrun.tools.ablate import train_arms

    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a file, not a folder")
    arms = plan(args)
    train_arms(arms, "noise study")
    (cfg, first), k, r = arms[0].runs[0], len(arms), len(arms[0].runs)
    print(f"noise of {cfg.recipe}: {k} seed(s) x {r} repeats (runs in {first.parent}):")
    print(report(arms, args.effect))
    return 0
