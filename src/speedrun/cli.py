"""Command line: `speedrun train | prepare | recipes | sample | eval | compare | bench | verify | ablate
| race | noise | doctor | certify`. `main` turns every failure a user can cause or meet into one stderr
line and an exit code: SpeedrunError (2 usage, 1 runtime), OSError and out of memory (1), a clean stop by
a signal (128 + signal), a closed pipe."""

from __future__ import annotations

import argparse
import copy
import errno
import importlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import speedrun
from speedrun.errors import ConfigError, SpeedrunError, Stopped, first_line
from speedrun.printable import ESCAPE

if TYPE_CHECKING:
    from speedrun.config import Config

# `--resume RUN` continues with RUN's saved recipe and folder: only these train options mean anything then.
RESUME_OPTIONS = ("resume", "dry_run", "overrides")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, instead of usage + error
        raise ConfigError(f"{self.prog}: {message} (see --help)")


#: Every command and the function that runs it, "module:function", imported only when that command runs
#: (so `speedrun recipes NAME --json` never imports torch or the tools; the index counts parameters
#: with torch on the meta device). Each takes the parsed arguments.
COMMANDS = {
    "train": "speedrun.cli:_cmd_train",
    "prepare": "speedrun.cli:_cmd_prepare",
    "recipes": "speedrun.cli:_cmd_recipes",
    "sample": "speedrun.tools.commands:cmd_sample",
    "eval": "speedrun.tools.commands:cmd_eval",
    "compare": "speedrun.tools.commands:cmd_compare",
    "bench": "speedrun.tools.commands:cmd_bench",
    "verify": "speedrun.tools.verify:cmd_verify",
    "ablate": "speedrun.tools.ablate:cmd_ablate",
    "race": "speedrun.tools.race:cmd_race",
    "noise": "speedrun.tools.noise:cmd_noise",
    "doctor": "speedrun.tools.doctor:cmd_doctor",
    "certify": "speedrun.tools.certify:cmd_certify",
}


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="speedrun", description="Train GPT-2-class models fast: the NanoGPT speedrun as a package."
    )
    parser.add_argument("--version", action="version", version=f"speedrun {speedrun.__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    train = sub.add_parser("train", help="train a recipe (default: the CPU demo)")
    train.add_argument("--recipe", default=None, help="bundled recipe name or .toml file (default demo)")
    train.add_argument("--out", type=Path, default=None, help="run directory (default runs/<recipe>-<time>)")
    train.add_argument("--dry-run", action="store_true", help="print the resolved config and model summary")
    train.add_argument("--resume", type=Path, default=None, help="continue the run in RUN_DIR")
    train.add_argument(
        "--seeds", metavar="S1,S2,...", help="run once per seed (train.seed) into sibling folders OUT-seedS"
    )
    overrides = train.add_argument(
        "overrides", nargs="*", metavar="key=value", help="e.g. model.n_layer=4 train.steps=50"
    )
    train.set_defaults(trailing=overrides)

    prep = sub.add_parser("prepare", help="build token shards from a text source")
    prep.add_argument(
        "source",
        help="wiki-vital | text:PATH | hf:OWNER/NAME[:CONFIG][@SPLIT] | fineweb10B[:N] | hellaswag",
    )
    prep.add_argument("--tokenizer", default=None, help="gpt2 | bpe:N (default gpt2)")
    prep.add_argument("--data-dir", type=Path, default=None, help="output folder (default data/<source>)")
    prep.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    prep.add_argument("--max-tokens", type=int, default=None, help="stop after about this many tokens")
    prep.add_argument(
        "--bpe-sample-mb", type=int, help="bpe:N trains on this many MB of train text (default 100)"
    )

    recipes = sub.add_parser("recipes", help="the recipe index, or one recipe's summary")
    recipes.add_argument("name", nargs="?", help="one recipe: provenance, what it adds, how to run it")
    recipes.add_argument("--json", action="store_true", help="with NAME: its fully resolved config as JSON")

    doctor = sub.add_parser("doctor", help="preflight of this host: one line per check (ok / warn / fail)")
    doctor.add_argument("--recipe", default=None, help="also compare the recipe's memory estimate")
    doctor.add_argument(
        "--nproc", type=int, default=None, help="processes per node for the estimate (default: the GPUs)"
    )
    doctor.set_defaults(
        trailing=doctor.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    )

    from speedrun.tools.commands import add_tool_commands

    add_tool_commands(sub)
    from speedrun.tools.certify import add_parser as add_certify

    add_certify(sub)
    for command in sub.choices.values():  # its errors name it; --resume names the options it would ignore
        command.set_defaults(command_parser=command)
    return parser


def _dumps(obj: object) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False)


def _dry_run(cfg: Config) -> None:
    """--dry-run's resolved config, after the time budget refused or skipped what a run would."""
    from speedrun.train.plan.budget import settle_budget

    settle_budget(cfg, lambda line: print(line, file=sys.stderr))
    print(_dumps(cfg.to_dict()))


def _cmd_train(args: argparse.Namespace) -> int:
    from speedrun.recipes import DEFAULT_RECIPE, load_recipe

    if args.resume is not None:
        return _resume(args)
    if args.seeds is not None:
        from speedrun.tools.commands import train_seeds

        return train_seeds(args)
    cfg = load_recipe(DEFAULT_RECIPE if args.recipe is None else args.recipe, args.overrides)
    if args.dry_run:
        _dry_run(cfg)
        print(_model_summary(cfg))
        return 0
    from speedrun.train.loop import train

    train(cfg, args.out)
    return 0


def _model_summary(cfg: Config) -> str:
    """--dry-run's model summary: the first thing that needs torch (the config printed before it is
    loaded and checked without it, docs/architecture.md), so a missing torch ends here in one line."""
    try:
        import torch  # noqa: F401  (whether torch imports at all)
    except ImportError as e:
        raise SpeedrunError(
            f"the model summary of --dry-run needs torch, which cannot be imported ({e})"
        ) from None
    from speedrun.config.labels import format_table
    from speedrun.model.summary import model_summary
    from speedrun.optim.build import model_rules, run_rules
    from speedrun.train.flops import config_model, first_and_last

    model = config_model(cfg)  # on the meta device: counts and shapes only, no memory, no init time
    params: dict[str, tuple[int, int]] = {}
    for e in model_rules(model, cfg):  # refuses a label without a row, a row without a parameter
        tensors, numbers = params.get(e.label.name, (0, 0))
        params[e.label.name] = (tensors + 1, numbers + e.param.numel())
    return (
        model_summary(model, cfg, first_and_last(model, cfg))
        + "\n"
        + _memory_lines(cfg)
        + "\n"
        + format_table(cfg.optim, run_rules(cfg), params)
    )


def _memory_lines(cfg: Config) -> str:
    """The memory guard's estimate of one compiled CUDA training step per process on 1 and 8 processes,
    in the precision a GPU run takes (`train.dtype=auto` is bf16 there), as the guard counts it."""
    import dataclasses

    from speedrun.train.plan.memory import estimate_memory

    if cfg.train.dtype == "auto":
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype="bf16"))
    lines = ["memory per process (estimate of a compiled CUDA step, train/plan/memory.py):"]
    for world in (1, 8):
        e = estimate_memory(cfg, world, compiled=True)
        lines.append(
            f"  {world} process{'es' if world > 1 else ''}: {e.total / 2**30:,.2f} GiB "
            f"(weights {e.weights / 2**30:,.2f}, optimizer {e.optimizer / 2**30:,.2f}, "
            f"activations {(e.activations + e.logits) / 2**30:,.2f})"
        )
    return "\n".join(lines)


def _refuse_ignored_options(args: argparse.Namespace) -> None:
    """Every train option other than RESUME_OPTIONS would be silently ignored by --resume: refuse it."""
    for action in args.command_parser._actions:
        if action.dest in RESUME_OPTIONS or not action.option_strings or action.dest == "help":
            continue
        if getattr(args, action.dest) != action.default:
            raise ConfigError(
                f"{action.option_strings[0]} cannot be used with --resume: a resumed run continues in "
                f"{args.resume} with its saved recipe (only key=value settings such as "
                "train.val_every may change)"
            )


def _resume(args: argparse.Namespace) -> int:
    """Continue RUN_DIR with its saved config; only settings that do not change the computation may change."""
    from speedrun.config.checks import validate
    from speedrun.config.files import RESUMABLE_CHANGES, check_resume, parse_overrides, read_run_config
    from speedrun.train.run.rundir import refuse_checkpoint_folder

    _refuse_ignored_options(args)
    run_dir = args.resume
    refuse_checkpoint_folder(run_dir, resume=True)  # a checkpoint, an over-long name: before reading it
    old = read_run_config(run_dir)
    cfg = copy.deepcopy(old)
    parse_overrides(cfg, args.overrides)

    def refuse(key: str, before: object, after: object) -> ConfigError:
        allowed = ", ".join(k for k in RESUMABLE_CHANGES if k != "description")
        return ConfigError(
            f"cannot resume with {key} changed ({before!r} -> {after!r}); only {allowed} may change"
        )

    for key, before, after in check_resume(old, cfg, refuse):  # the resume rule first: it names the key
        print(f"resume: {key} changed from {before!r} to {after!r}")
    validate(cfg)
    if args.dry_run:
        _dry_run(cfg)
        return 0
    from speedrun.train.loop import train

    train(cfg, run_dir, resume=True)
    return 0


#: The options of `prepare` each kind of source acts on; any other one given is refused as usage (it
#: would be ignored). `--bpe-sample-mb` acts only with a bpe:N tokenizer.
PREPARE_OPTIONS = {
    "hellaswag": ("--data-dir",),  # a text eval set, downloaded as it is
    "fineweb10B": ("--data-dir", "--tokenizer"),  # pre-tokenized gpt2 shards, downloaded as they are
    "text": ("--data-dir", "--tokenizer", "--workers", "--max-tokens", "--bpe-sample-mb"),
}


def _check_prepare_options(args: argparse.Namespace) -> None:
    """ConfigError naming the first option given that this source (or tokenizer) would not use."""
    from speedrun.config.data import parse_fineweb_source

    kind = "hellaswag" if args.source == "hellaswag" else "text"
    kind = "fineweb10B" if parse_fineweb_source(args.source) is not None else kind
    keys = ("data_dir", "tokenizer", "workers", "max_tokens", "bpe_sample_mb")  # their defaults: None
    given = [f"--{key.replace('_', '-')}" for key in keys if getattr(args, key) is not None]
    for flag in (f for f in given if f not in PREPARE_OPTIONS[kind]):
        what = "a text eval set" if kind == "hellaswag" else "pre-tokenized gpt2 shards"
        raise ConfigError(f"{flag} does not apply to {args.source!r} ({what}, downloaded as it is)")
    if "--bpe-sample-mb" in given and not (args.tokenizer or "gpt2").startswith("bpe:"):
        raise ConfigError("--bpe-sample-mb applies to a bpe:N tokenizer (the sample it trains on)")


def _cmd_prepare(args: argparse.Namespace) -> int:
    from speedrun.data.prepare import prepare

    _check_prepare_options(args)
    if args.source == "hellaswag":
        from speedrun.tools.hellaswag import DEFAULT_DIR, download_hellaswag

        download_hellaswag(args.data_dir or DEFAULT_DIR)
        return 0
    sample_mb = 100 if args.bpe_sample_mb is None else args.bpe_sample_mb
    if sample_mb < 1:
        raise ConfigError(f"--bpe-sample-mb must be at least 1, got {sample_mb}")
    path = prepare(
        args.source,
        args.tokenizer or "gpt2",
        args.data_dir,
        workers=args.workers,
        max_tokens=args.max_tokens,
        bpe_sample_bytes=sample_mb * 1_000_000,
    )
    print(f"prepared {args.source} in {path}")
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    """The recipe index (one line a recipe); or one recipe's summary, or its resolved config as JSON."""
    from speedrun.recipes import load_recipe, recipe_names
    from speedrun.recipes.index import index_lines, summary

    if args.name is None:  # `recipes ""` (an unset shell variable) is an unknown name, not the list
        if args.json:
            raise ConfigError("recipes --json needs a recipe name (speedrun recipes NAME --json)")
        print("\n".join(index_lines()))
    elif args.json or args.name not in recipe_names():  # a file of the user's own has no provenance
        print(_dumps(load_recipe(args.name).to_dict()))  # JSON alone: scripts parse it
    else:
        print(summary(args.name, shutil.get_terminal_size().columns))
    return 0


def _say(message: str, error: BaseException | None = None) -> None:
    """Print a user-facing line on stderr; under torchrun only rank 0 speaks (the others would repeat it),
    unless the error is about the rank itself."""
    rank = os.environ.get("RANK", "0")
    world = os.environ.get("WORLD_SIZE", "1")
    # RANK alone (a scheduler's variable, a stale export) is no multi-process launch: say it
    if rank == "0" or not (world.isdigit() and int(world) > 1):
        print(message, file=sys.stderr)
    elif getattr(error, "rank_specific", False):
        print(message.replace("speedrun: ", f"speedrun (rank {rank}): ", 1), file=sys.stderr)


_WRITE_ERRORS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG}


def _os_error(e: OSError) -> str:
    text = e.strerror or str(e) or type(e).__name__
    if e.filename is None:
        return text
    if e.errno == errno.ENAMETOOLONG:  # the name that is too long, not a file we would make inside it
        from speedrun.atomic import name_too_long

        if (why := name_too_long(e.filename)) is not None:
            return why
    verb = "cannot write " if e.errno in _WRITE_ERRORS else ""
    return f"{verb}{e.filename}: {text}"


class _NamedStdout:
    """sys.stdout whose write errors name it, so `speedrun recipes > /dev/full` says "cannot write
    standard output" instead of reading like a full disk."""

    def __init__(self, stream: Any):
        self._stream = stream

    def _named(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as e:
            e.filename = e.filename or "standard output"
            raise

    def write(self, text: str) -> int:
        return self._named(self._stream.write, text)

    def flush(self) -> None:
        self._named(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _is_out_of_memory(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, MemoryError) or "out of memory" in text or "can't allocate memory" in text


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse, letting a command's list of words continue after an option (`train --out x model.n_layer=2`):
    argparse fills a `*`/`+` positional once, from the words before the first option."""
    args, extras = parser.parse_known_args(argv)
    trailing = getattr(args, "trailing", None)  # the Action of the command's list positional
    if extras and trailing is not None and not any(e.startswith("-") for e in extras):
        convert = trailing.type or str
        setattr(args, trailing.dest, [*getattr(args, trailing.dest), *map(convert, extras)])
    elif extras:  # named by the command's parser: `speedrun train: ...`, whose --help lists its options
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # huggingface_hub logs each retry of a failing download as a warning on stderr; the failure itself
    # ends as our one line naming the file, so its retries would only be noise around it
    # (read when huggingface_hub is imported; a user's own HF_HUB_VERBOSITY wins)
    os.environ.setdefault("HF_HUB_VERBOSITY", "error")
    parser = _build_parser()
    for stream in (sys.stdout, sys.stderr):  # a path's non-UTF-8 byte, an ASCII terminal: no traceback
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=ESCAPE)
    stdout, sys.stdout = sys.stdout, _NamedStdout(sys.stdout)
    try:
        args = parse(parser, argv)
        if args.command is None:  # `speedrun` alone: help, never a run (`speedrun train` is the demo)
            parser.print_help()
            return 0
        module, function = COMMANDS[args.command].split(":")
        code = getattr(importlib.import_module(module), function)(args)
        sys.stdout.flush()  # a full or closed stdout fails here, inside the one-line mapping below
        return code
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except Stopped as e:  # a clean stop (checkpoint saved) is not an error
        _say(f"speedrun: {e}", e)
        return e.exit_code
    except SpeedrunError as e:
        _say(f"speedrun: error: {e}", e)
        return e.exit_code
    except BrokenPipeError:  # `speedrun recipes | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as e:  # disk full, read-only folder, permission denied: the file and the reason
        _say(f"speedrun: error: {_os_error(e)}", e)
        return 1
    except (MemoryError, RuntimeError) as e:
        if not _is_out_of_memory(e):
            raise
        advice = "try a smaller train.micro_batch_tokens or model"
        _say(f"speedrun: error: out of memory ({first_line(e)}); {advice}", e)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C; in prepare also SIGTERM and SIGHUP (data/pipeline.py)
        signum = getattr(e, "signum", signal.SIGINT)
        by = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
        _say(f"speedrun: interrupted{by}")
        return 128 + signum
    finally:
        sys.stdout = stdout
