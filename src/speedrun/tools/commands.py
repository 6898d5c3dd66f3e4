"""The research subcommands of `speedrun` (sample, eval, compare, bench, verify, ablate, race, noise)
and `train --seeds`; cli.py owns the parser and the error handling."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

from speedrun.errors import ConfigError
from speedrun.tools.seeds import parse_seeds

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.manual_seed accepts
#: The most runs or steps a research command plans (docs/research.md): far beyond any study on one
#: machine, and small enough that a typo of a few more digits is refused before any memory is spent.
MOST_PAIRS, MOST_REPEATS, MOST_BENCH_STEPS = 1000, 100, 100_000


def count(least: int, most: int) -> Callable[[str], int]:
    """An argparse type: an integer in [least, most], else argparse's one-line usage error naming both."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"{text} is outside {least}..{most:,}")
        return value

    return parse


def add_tool_commands(sub: argparse._SubParsersAction) -> None:
    sample = sub.add_parser("sample", help="generate text from a trained run (KV-cached, streamed)")
    sample.add_argument("path", type=Path, metavar="RUN_DIR|CHECKPOINT")
    sample.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    sample.add_argument("-n", type=int, default=1, help="number of samples (default 1)")
    sample.add_argument("--max-tokens", type=int, default=200, help="tokens per sample (default 200)")
    sample.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    sample.add_argument("--top-k", type=int, default=200, help="sample among the k likeliest; 0 = all")
    sample.add_argument("--seed", type=int, default=1337, help="random seed (default 1337)")
    sample.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    sample.add_argument("--data", type=Path, default=None, help="data folder holding the run's tokenizer")

    ev = sub.add_parser("eval", help="val loss and bits per byte (or HellaSwag) of a trained run")
    ev.add_argument("path", type=Path, metavar="RUN_DIR|CHECKPOINT")
    ev.add_argument("--data", type=Path, default=None, help="prepared shard folder (default: the run's)")
    ev.add_argument("--tokens", type=int, default=None, help="val tokens (default: the run's val_tokens)")
    ev.add_argument(
        "--hellaswag",
        nargs="?",
        type=Path,
        const=Path("data/hellaswag/hellaswag_val.jsonl"),
        default=None,
        metavar="FILE",
        help="HellaSwag accuracy instead (GPT-2 tokenizer only; default file from `prepare hellaswag`)",
    )
    ev.add_argument("--limit", type=int, default=None, help="score only the first N HellaSwag examples")
    ev.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")

    cmp = sub.add_parser("compare", help="table, t-test and plots of several runs")
    cmp.set_defaults(trailing=cmp.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR"))
    cmp.add_argument("--target", type=float, default=3.28, help="val loss target (default 3.28)")
    cmp.add_argument("--plot", type=Path, default=None, help="write val-loss curves to this PNG")
    cmp.add_argument(
        "--x", choices=("tokens", "flops"), default="tokens", help="--plot's first axis (default tokens)"
    )

    bench = sub.add_parser("bench", help="time a recipe's training step on synthetic tokens")
    bench.add_argument("--recipe", default="demo", help="bundled recipe name or path to a .toml file")
    bench.add_argument(
        "--steps", type=count(1, MOST_BENCH_STEPS), default=10, help="timed steps (default 10)"
    )
    bench.add_argument(
        "--warmup", type=count(0, MOST_BENCH_STEPS), default=3, help="untimed steps first (compile, warm-up)"
    )
    bench.add_argument(
        "--stage", default=None, metavar="N[,M...]", help="time only these stages of train.stages (1 = first)"
    )
    bench.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    bench.add_argument("--json", type=Path, default=None, help="also write the numbers to this JSON file")
    bench.set_defaults(
        trailing=bench.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. model.n_layer=4")
    )

    verify = sub.add_parser("verify", help="check runs against the record rules, one line per rule")
    verify.set_defaults(trailing=verify.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR"))
    verify.add_argument("--track", type=int, choices=(1, 3), default=1, help="1: time (default) | 3: steps")
    verify.add_argument("--target", type=float, default=3.28, help="val loss target (default 3.28)")
    verify.add_argument(
        "--baseline",
        nargs="+",
        action="extend",
        type=Path,
        metavar="RUN_DIR",
        help="the record to beat, re-run here",
    )
    verify.add_argument("--json", type=Path, default=None, help="also write the verdicts to this JSON file")

    ablate = sub.add_parser("ablate", help="train a recipe and one-switch variants over seeds, then a table")
    _many_runs(ablate, "every arm", seeds=True)
    ablate.set_defaults(
        trailing=ablate.add_argument(
            "switches", nargs="+", metavar="SWITCH=VALUE", help="one variant each (KEY=V+KEY=V: several keys)"
        )
    )

    race = sub.add_parser("race", help="paired same-hardware timing of A (a recipe) against B (switches)")
    _many_runs(race, "both arms", seeds=False)
    race.add_argument(
        "--pairs", type=count(1, MOST_PAIRS), default=4, help="runs per arm, one seed per pair (default 4)"
    )
    race.add_argument("--seed", type=int, default=0, help="seed of the ABBA/BAAB block order (default 0)")
    race.add_argument(
        "--python-b", default=None, metavar="PY", help="run arm B with this Python (another checkout)"
    )
    race.add_argument(
        "--allow-mixed-cache", action="store_true", help="time cold- and warm-compile-cache legs together"
    )
    race.set_defaults(
        trailing=race.add_argument("switches", nargs="*", metavar="SWITCH=VALUE", help="what makes B")
    )

    noise = sub.add_parser(
        "noise", help="repeats of each seed: nondeterminism, seed noise, runs an effect needs"
    )
    _many_runs(noise, "every run", seeds=True)
    noise.add_argument(
        "--repeats", type=count(2, MOST_REPEATS), default=2, help="runs of each seed (default 2)"
    )
    noise.add_argument(
        "--effect", type=float, default=None, help="also: runs needed to show this val loss difference"
    )


def _many_runs(parser: argparse.ArgumentParser, each: str, seeds: bool) -> None:
    """The options ablate, race and noise share: the recipe, the runs' folder, overrides (and seeds)."""
    name = parser.prog.split()[-1]
    parser.add_argument("--recipe", required=True, help="bundled recipe name or .toml file")
    if seeds:
        parser.add_argument(
            "--seeds", default="3", metavar="N|S1,S2,...", help="N seeds (1..N) or a list (default 3)"
        )
    parser.add_argument(
        "--out", type=Path, default=None, help=f"folder of the runs (default runs/{name}-<recipe>)"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="key=value", help=f"an override for {each} (repeat it)"
    )


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value}")


def cmd_sample(args: argparse.Namespace) -> int:
    from speedrun.tools.runs import load_model, resolve_device, run_tokenizer
    from speedrun.tools.sample import run_sample
    from speedrun.train.step import autocast, autocast_dtype

    _positive("-n", args.n)
    _positive("--max-tokens", args.max_tokens)
    if not math.isfinite(args.temperature) or args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--temperature must be a finite number >= 0 and --top-k must not be negative")
    if not SEED_MIN <= args.seed <= SEED_MAX:
        raise ConfigError(f"--seed must be between {SEED_MIN} and {SEED_MAX} (64 bits), got {args.seed}")
    device = resolve_device(args.device)
    model, cfg, ckpt = load_model(args.path, device)
    tokenizer = run_tokenizer(cfg, args.data, ckpt)
    room = cfg.model.max_seq_len - 1 - len(tokenizer.encode(args.prompt))
    if room < 1:
        raise ConfigError(f"--prompt is longer than the model's context ({cfg.model.max_seq_len} tokens)")
    if args.max_tokens > room:
        print(
            f"speedrun: note: --max-tokens capped at {room} (context {cfg.model.max_seq_len})",
            file=sys.stderr,
        )
    with autocast(device, autocast_dtype(cfg)):
        top_k = args.top_k or None
        run_sample(model, tokenizer, args.prompt, args.n, args.max_tokens, args.temperature, top_k, args.seed)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from speedrun.data.meta import data_dir_for
    from speedrun.tools.runs import load_model, resolve_device, run_tokenizer

    _positive("--tokens", args.tokens)
    _positive("--limit", args.limit)
    if args.limit is not None and args.hellaswag is None:
        raise ConfigError("--limit counts HellaSwag examples: it needs --hellaswag (val loss reads --tokens)")
    device = resolve_device(args.device)
    model, cfg, ckpt = load_model(args.path, device)
    if args.hellaswag is not None:
        from speedrun.tools.hellaswag import evaluate_hellaswag

        if cfg.data.tokenizer != "gpt2":
            raise ConfigError(
                f"HellaSwag needs a GPT-2-tokenized model; {args.path} uses {cfg.data.tokenizer}"
            )
        tokenizer = run_tokenizer(cfg, checkpoint=ckpt)
        result = evaluate_hellaswag(model, cfg, tokenizer, args.hellaswag, args.limit, device)
        print(
            f"hellaswag: {result['examples']:,} examples | acc {result['acc']:.4f} | "
            f"acc_norm {result['acc_norm']:.4f} | checkpoint {ckpt}"
        )
        return 0
    from speedrun.tools.evaluate import evaluate_loss

    result = evaluate_loss(model, cfg, args.data or data_dir_for(cfg), args.tokens, device, ckpt)
    bpb = f" | val bpb {result['val_bpb']:.4f}" if result["val_bpb"] is not None else ""
    print(
        f"val loss {result['val_loss']:.4f}{bpb} | {result['tokens']:,} tokens of {result['data']} | "
        f"checkpoint {ckpt}"
    )
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from speedrun.tools import compare, results, stats

    if not math.isfinite(args.target):
        raise ConfigError(f"--target must be a finite val loss, got {args.target}")
    if args.x != "tokens" and args.plot is None:
        raise ConfigError(f"--x {args.x} chooses --plot's axis: add --plot FILE.png")
    if args.plot is not None:
        # before the work: a link, FIFO or run file at --plot, or a missing extra, is said now
        results.check_report(args.plot, "--plot")
        stats.research_module("matplotlib", "compare --plot")
    loaded = results.load_runs(args.runs)
    print(compare.format_table(loaded, compare.make_groups(loaded, args.target), args.target))
    if args.plot is not None:
        print(f"plot: {compare.plot_runs(loaded, args.plot, args.target, args.x)}")
    return 0


def train_seeds(args: argparse.Namespace) -> int:
    """One run per seed into OUT-seedS (OUT defaults to runs/<recipe>-<time>), then a compare hint."""
    from speedrun.recipes import DEFAULT_RECIPE, load_recipe
    from speedrun.train.run.rundir import default_run_dir

    seeds = parse_seeds(args.seeds)
    if any(o.strip().startswith("train.seed=") for o in args.overrides):
        raise ConfigError("--seeds sets train.seed itself; drop the train.seed= override")
    recipe = DEFAULT_RECIPE if args.recipe is None else args.recipe
    configs = [load_recipe(recipe, [*args.overrides, f"train.seed={s}"]) for s in seeds]
    base = args.out or default_run_dir(configs[0].recipe)
    if base.name in ("", ".", ".."):  # `--out .` or `/`: there is no folder name to add -seedS to
        raise ConfigError(f"--out {base} with --seeds: name a folder (runs go into OUT-seedS beside it)")
    dirs = [base.with_name(f"{base.name}-seed{s}") for s in seeds]
    if args.dry_run:
        print(json.dumps(configs[0].to_dict(), indent=2))
        for s, d in zip(seeds, dirs, strict=True):
            print(f"seed {s}: {d}")
        return 0
    from speedrun.config.files import read_run_config
    from speedrun.tools.ablate import state
    from speedrun.train.loop import train
    from speedrun.train.run.rundir import check_new
    from speedrun.train.signals import RunInterrupted

    # with --out, the same command again goes on where a stopped one left off (issue 46): finished seeds are
    # reused, a stopped one resumes; without it each call names new folders by the time
    found = [state(d, c) if args.out else "new" for d, c in zip(dirs, configs, strict=True)]
    for out, f in zip(dirs, found, strict=True):  # before the first run: a taken folder fails only after it
        if f == "other":
            raise ConfigError(f"{out} holds a run of another config; choose another --out")
        if f in ("new", "broken"):
            check_new(out)
    for s, (cfg, out) in enumerate(zip(configs, dirs, strict=True)):
        if found[s] == "finished":
            tag = f"seed {seeds[s]} ({s + 1}/{len(seeds)}): {out}"
            print(f"=== {tag}: finished before, reused ===", flush=True)
            continue
        print(f"=== seed {seeds[s]} ({s + 1}/{len(seeds)}): {out} ===", flush=True)
        if s > 0:  # repeats of the first run as it ran: its time budget fixed the steps and the host probe
            cfg = read_run_config(dirs[0])  # the batch; measured again, they could differ, and compare
            cfg.train.seed = seeds[s]  # would put the repeats in groups of one
        try:
            if found[s] == "stopped":
                train(read_run_config(out), out, resume=True)
            else:
                train(cfg, out)
        except RunInterrupted as e:  # the remedy: the same command (it resumes this seed, then the rest)
            stop, again = str(e).partition("; resume with:")[0], "run the same command again to go on"
            raise RunInterrupted(f"{stop}; {again}" if args.out else str(e), e.exit_code - 128) from None
    print(f"compare them with: speedrun compare {' '.join(str(d) for d in dirs)}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from speedrun.atomic import write_atomic
    from speedrun.recipes import load_recipe
    from speedrun.tools.bench import format_bench, parse_stages_option, run_bench
    from speedrun.tools.results import check_report
    from speedrun.tools.runs import resolve_device

    if args.json is not None:
        check_report(args.json, "--json")
    cfg = load_recipe(args.recipe, args.overrides)
    stages = parse_stages_option(cfg, args.stage) if args.stage is not None else None
    if cfg.train.device != "auto" and args.device == "auto":
        args.device = cfg.train.device
    result = run_bench(cfg, resolve_device(args.device), args.steps, args.warmup, stages)
    print(format_bench(result))
    if args.json is not None:
        write_atomic(args.json, (json.dumps(result, indent=2) + "\n").encode())
        print(f"json: {args.json}")
    return 0
