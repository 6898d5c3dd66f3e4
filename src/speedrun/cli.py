"""Command line: `speedrun train | prepare | recipes | sample | eval | compare | bench`.

User mistakes end in one stderr line, no traceback."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from speedrun.errors import ConfigError, SpeedrunError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, instead of usage + error
        raise ConfigError(f"{self.prog}: {message} (see --help)")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="speedrun", description="Train GPT-2-class models fast: the NanoGPT speedrun as a package."
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    train = sub.add_parser("train", help="train a recipe (default: the CPU demo)")
    train.add_argument("--recipe", default="demo", help="bundled recipe name or path to a .toml file")
    train.add_argument("--out", type=Path, default=None, help="run directory (default runs/<recipe>-<time>)")
    train.add_argument("--dry-run", action="store_true", help="print the resolved config and model summary")
    train.add_argument("--resume", type=Path, default=None, help="continue the run in RUN_DIR")
    train.add_argument(
        "--seeds",
        default=None,
        metavar="S1,S2,...",
        help="run once per seed (train.seed) into sibling run directories OUT-seedS, ready for compare",
    )
    train.add_argument(
        "overrides", nargs="*", metavar="key=value", help="e.g. model.n_layer=4 train.steps=50"
    )

    prep = sub.add_parser("prepare", help="build token shards from a text source")
    prep.add_argument(
        "source",
        help="wiki-vital | text:PATH | hf:OWNER/NAME[:CONFIG][@SPLIT] | fineweb10B[:N] | hellaswag",
    )
    prep.add_argument("--tokenizer", default="gpt2", help="gpt2 | bpe:N (default gpt2)")
    prep.add_argument("--data-dir", type=Path, default=None, help="output folder (default data/<source>)")
    prep.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    prep.add_argument("--max-tokens", type=int, default=None, help="stop after about this many tokens")
    prep.add_argument(
        "--bpe-sample-mb",
        type=int,
        default=100,
        help="bpe:N trains on the first this many MB of train-split text (default 100)",
    )

    recipes = sub.add_parser("recipes", help="list the bundled recipes")
    recipes.add_argument("name", nargs="?", help="show one recipe's resolved config")

    from speedrun.tools.commands import add_tool_commands

    add_tool_commands(sub)
    return parser


def _cmd_train(args: argparse.Namespace) -> int:
    from speedrun.recipes import load_recipe

    if args.resume is not None:
        if args.seeds is not None:
            raise ConfigError("--seeds starts new runs; it cannot be combined with --resume")
        return _resume(args)
    if args.seeds is not None:
        from speedrun.tools.commands import train_seeds

        return train_seeds(args)
    cfg = load_recipe(args.recipe, args.overrides)
    if args.dry_run:
        import torch

        from speedrun.model.gpt import GPT
        from speedrun.model.summary import model_summary

        print(json.dumps(cfg.to_dict(), indent=2))
        with torch.device("meta"):  # counts and shapes only: no memory, no init time
            model = GPT(cfg.model)
        print(model_summary(model, cfg.train.seq_len))
        return 0
    from speedrun.train.loop import train

    train(cfg, args.out)
    return 0


def _resume(args: argparse.Namespace) -> int:
    """Continue RUN_DIR with its saved config; only settings that do not change the computation may change."""
    from speedrun.config import RESUMABLE_CHANGES, changed_keys, config_from_dict, parse_overrides, validate
    from speedrun.train.loop import train

    run_dir = args.resume
    try:
        saved = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--resume {run_dir}: not a run directory (no config.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--resume {run_dir}: config.json is unreadable ({e})") from None
    old = config_from_dict(saved, str(run_dir / "config.json"))
    cfg = config_from_dict(saved, str(run_dir / "config.json"))
    parse_overrides(cfg, args.overrides)
    validate(cfg)
    for key, before, after in changed_keys(old, cfg):
        if key not in RESUMABLE_CHANGES:
            raise ConfigError(
                f"cannot resume with {key} changed ({before!r} -> {after!r}); "
                f"only {', '.join(k for k in RESUMABLE_CHANGES if k != 'description')} may change"
            )
        print(f"resume: {key} changed from {before!r} to {after!r}")
    if args.dry_run:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    train(cfg, run_dir, resume=True)
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from speedrun.data.prepare import prepare

    if args.source == "hellaswag":
        from speedrun.tools.hellaswag import DEFAULT_DIR, download_hellaswag

        if args.tokenizer != "gpt2":
            raise ConfigError("hellaswag is a text eval set; it takes no --tokenizer")
        download_hellaswag(args.data_dir or DEFAULT_DIR)
        return 0
    if args.bpe_sample_mb < 1:
        raise ConfigError(f"--bpe-sample-mb must be at least 1, got {args.bpe_sample_mb}")
    path = prepare(
        args.source,
        args.tokenizer,
        args.data_dir,
        workers=args.workers,
        max_tokens=args.max_tokens,
        bpe_sample_bytes=args.bpe_sample_mb * 1_000_000,
    )
    print(f"prepared {args.source} in {path}")
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    from speedrun.recipes import load_recipe, recipe_names

    if args.name:
        print(json.dumps(load_recipe(args.name).to_dict(), indent=2))
        return 0
    names = recipe_names()
    width = max(map(len, names))
    for name in names:
        desc = " ".join(load_recipe(name).description.split())
        print(f"{name:<{width}}  {desc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _build_parser()
    try:
        args = parser.parse_args(argv or ["train"])
        from speedrun.tools.commands import TOOL_COMMANDS

        handlers = {"train": _cmd_train, "prepare": _cmd_prepare, "recipes": _cmd_recipes, **TOOL_COMMANDS}
        handler = handlers[args.command]
        return handler(args)
    except SpeedrunError as e:
        print(f"speedrun: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("speedrun: interrupted", file=sys.stderr)
        return 130
