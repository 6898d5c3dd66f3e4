# ruff: noqa: E501 (tables of trials read best one per line)
"""The fifth round's trials other than resume (tests/trials_bad_inputs.py runs them): stage plans, verify on
odd files, ablate's refusals, sample's options, odd CLI inputs and files. Most are refused before any
training; a trial passes when the refusal is one line with the expected exit code (or the run works)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import TINY
from tests.trials_bad_inputs import cli, tiny, trial

FAST = ["train.steps=4", "train.warmdown_steps=1", "train.val_every=0", "train.timing_warmup_steps=0"]


def finished_run(data: Path, work: Path) -> Path:
    run = work / "demo-run"
    if not (run / "summary.json").is_file():
        shutil.rmtree(run, ignore_errors=True)
        code, _, err = cli(
            "train", "--out", run, *TINY, *FAST, f"data.dir={data}", "train.checkpoint_at_end=true"
        )
        assert code == 0, err
    return run


def edited(run: Path, dest: Path, name: str, change) -> Path:
    """A copy of `run` whose file `name` is replaced by change(text) (None: removed)."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(run, dest)
    text = change((dest / name).read_text()) if (dest / name).is_file() else change("")
    if text is None:
        (dest / name).unlink()
    else:
        (dest / name).write_text(text)
    return dest


def stage_plan_trials(data: Path, work: Path) -> None:
    base = ["train", "--recipe", "stages-2025-12", "--dry-run", *tiny("stages-2025-12", data)]
    ext = "tokens=512 windows=1/2 ext=0"
    plans = {
        "empty plan": ("", None),
        "only separators": (" ; ; ", None),
        "no extension stage": ("tokens=512 windows=1/1 frac=1", None),
        "no frac": (f"tokens=512 windows=1/1; {ext}", None),
        "zero tokens": (f"tokens=0 windows=1/1 frac=1; {ext}", 2),
        "negative tokens": (f"tokens=-512 windows=1/1 frac=1; {ext}", 2),
        "tokens not whole rows": (f"tokens=500 windows=1/1 frac=1; {ext}", None),  # rows of 250: varlen
        "window 0": (f"tokens=512 windows=0/1 frac=1; {ext}", 2),
        "short above long": (f"tokens=512 windows=2/1 frac=1; {ext}", None),
        "one window": (f"tokens=512 windows=1 frac=1; {ext}", 2),
        "three windows": (f"tokens=512 windows=1/1/1 frac=1; {ext}", 2),
        "letters as windows": (f"tokens=512 windows=a/b frac=1; {ext}", 2),
        "upper-case key": (f"TOKENS=512 windows=1/1 frac=1; {ext}", 2),
        "spaces around =": (f"tokens = 512 windows=1/1 frac=1; {ext}", None),
        "full-width digits": (f"tokens=５１２ windows=1/1 frac=1; {ext}", None),
        "tokens 1e3": (f"tokens=1e3 windows=1/1 frac=1; {ext}", 2),
        "lr nan": (f"tokens=512 windows=1/1 frac=1 lr=nan; {ext}", 2),
        "lr negative": (f"tokens=512 windows=1/1 frac=1 lr=-1; {ext}", 2),
        "doc 0": (f"tokens=512 windows=1/1 frac=1 doc=0; {ext}", None),
        "doc negative": (f"tokens=512 windows=1/1 frac=1 doc=-5; {ext}", 2),
        "extension first": (f"{ext}; tokens=512 windows=1/1 frac=1", 2),
        "two extensions": (f"tokens=512 windows=1/1 frac=1; {ext}; {ext}", 2),
        "val 0": (f"tokens=512 windows=1/1 frac=1; {ext} val=0", None),
        "windows past positions": (f"tokens=512 windows=1/9 frac=1; {ext}", None),
        "frac 0 stage": (f"tokens=512 windows=1/1 frac=0; tokens=512 windows=1/1 frac=1; {ext}", None),
        "fifty stages": ("; ".join(["tokens=512 windows=1/1 frac=1/50"] * 50) + f"; {ext}", None),
        "unknown key": (f"tokens=512 windows=1/1 frac=1 warp=9; {ext}", 2),
        "mtp weights odd": (f"tokens=512 windows=1/1 frac=1 mtp=1,x; {ext}", 2),
        "trailing semicolon": (f"tokens=512 windows=1/1 frac=1; {ext};", None),
        "newline inside": (f"tokens=512 windows=1/1 frac=1;\n{ext}", None),
    }
    for name, (text, code) in plans.items():
        trial(f"stages: {name}", [*base, f"train.stages={text}"], code)
    trial("stages: one step", [*base, "train.steps=1"], None)
    trial(
        "stages: plan on demo",
        ["train", "--dry-run", *TINY, "train.stages=tokens=1024 windows=1/1 frac=1"],
        2,
    )


def verify_trials(data: Path, work: Path) -> None:
    run = finished_run(data, work)
    v = work / "v"

    def summary(change):
        return lambda t: json.dumps(change(json.loads(t)))

    def with_starts(value):
        return summary(lambda s: {**s, "starts": value})

    odd = {
        "starts a string": ("summary.json", with_starts("x"), 1),
        "starts empty": ("summary.json", with_starts([]), 1),
        "start step a string": ("summary.json", with_starts([{"step": "0"}]), 1),
        "start without hardware": ("summary.json", with_starts([{"step": 0}]), 1),
        "start world_size true": (
            "summary.json",
            with_starts([{"step": 0, "world_size": True, "device_name": "x"}]),
            1,
        ),
        "starts out of order": (
            "summary.json",
            with_starts(
                [
                    {"step": 3, "world_size": 1, "device_name": "c", "timing_warmup_steps": 0},
                    {"step": 0, "world_size": 1, "device_name": "c", "timing_warmup_steps": 0},
                ]
            ),
            1,
        ),  # fmt: skip
        "negative warm-up": (
            "summary.json",
            with_starts([{"step": 0, "world_size": 1, "device_name": "c", "timing_warmup_steps": -3}]),
            1,
        ),
        "timed_steps a string": ("summary.json", summary(lambda s: {**s, "timed_steps": "4"}), 1),
        "summary an array": ("summary.json", lambda t: "[]", 1),
        "summary empty": ("summary.json", lambda t: "", 1),
        "summary removed": ("summary.json", lambda t: None, 1),
        "steps negative": ("summary.json", summary(lambda s: {**s, "steps": -1}), 1),
        "metrics empty": ("metrics.jsonl", lambda t: "", 1),
        "config lacks train": (
            "config.json",
            summary(lambda c: {k: v for k, v in c.items() if k != "train"}),
            1,
        ),
        "log binary": ("log.txt", lambda t: "\x00\xff garbage", 1),
        "log ends at code:": ("log.txt", lambda t: t + "code: speedrun 9 (installed package)", 1),
        "diff never ends": (
            "log.txt",
            lambda t: t.replace("python: ", "--- uncommitted diff ---\npython: ", 1),
            1,
        ),
        "log removed": ("log.txt", lambda t: None, 1),
    }
    for name, (file, change, code) in odd.items():
        copy = edited(run, v / name.replace(" ", "_").replace(":", ""), file, change)
        trial(f"verify: {name}", ["verify", copy, "--target", "9"], code)
    trial("verify: same run twice", ["verify", run, run, "--target", "9"], 1)
    trial("verify: target -inf", ["verify", run, "--target", "-inf"], 2)
    trial("verify: target 1e400", ["verify", run, "--target", "1e400"], 2)
    trial("verify: target word", ["verify", run, "--target", "abc"], 2)
    trial("verify: track 3 one run", ["verify", run, "--track", "3", "--target", "9"], None)
    trial("verify: a checkpoint", ["verify", run / "checkpoints" / "step_000004"], 1)
    trial("verify: a data folder", ["verify", data], 1)
    trial("verify: --json a folder", ["verify", run, "--json", work], None)
    trial("verify: --json the run's summary", ["verify", run, "--json", run / "summary.json"], 2)
    trial("verify: --json a data file", ["verify", run, "--json", data / "meta.json"], 2)
    unfinished = edited(run, v / "unfinished", "summary.json", lambda t: None)
    trial("verify: baseline a copy", ["verify", run, "--baseline", unfinished, "--target", "9"], 2)


def ablate_trials(data: Path, work: Path) -> None:
    base = ["ablate", "--recipe", "demo", "--out", work / "ab", "--seeds", "1"]
    sets = [x for o in [*TINY, *FAST, f"data.dir={data}"] for x in ("--set", o)]
    cases = {  # model.qk_norm (the demo: true) is not among the --set values
        "no switch": ([], 2),
        "switch without =": (["model.qk_norm"], 2),
        "switch with empty value": (["model.qk_norm="], 2),
        "unknown key": (["model.qk_normz=false"], 2),
        "the seed": (["train.seed=3"], 2),
        "switch twice": (["model.qk_norm=false", "model.qk_norm=false"], 2),
        "switch also set": (["train.steps=5"], 2),
        "baseline value": (["model.qk_norm=true"], 2),
        "baseline value spelled otherwise": (["model.qk_norm=True"], 2),
        "bad value": (["model.qk_norm=maybe"], 2),
        "reporting setting only": (["train.log_every=3"], 2),
        "checkpoint setting only": (["train.checkpoint_every=2"], 2),
        "leading space": ([" model.qk_norm=false"], None),
        "switch of data.dir": ([f"data.dir={work}"], None),
    }
    for name, (switches, code) in cases.items():
        trial(f"ablate: {name}", [*base, *sets, *switches], code)
    for seeds in ("0", "-1", "1,1", "a", "1,,2", " 1, 2", "2**70"):  # each refused: the seeds or the switch
        trial(f"ablate: --seeds {seeds!r}", ["ablate", "--recipe", "demo", "--seeds", seeds, "--out", work / "ab",
                                              *sets, "model.qk_norm=maybe"], 2)  # fmt: skip
    (work / "afile").write_text("x")
    trial(
        "ablate: --out a file",
        ["ablate", "--recipe", "demo", "--out", work / "afile", *sets, "model.qk_norm=false"],
        2,
    )
    trial(
        "ablate: --set malformed",
        ["ablate", "--recipe", "demo", "--set", "nonsense", "model.qk_norm=false"],
        2,
    )


def sample_trials(data: Path, work: Path) -> None:
    run = finished_run(data, work)
    cases = {
        "empty prompt": (["--prompt", ""], 0),
        "space prompt": (["--prompt", " "], 0),
        "NUL prompt": (["--prompt", "\x00"], 0),
        "surrogate prompt": (["--prompt", "a\udc80b"], None),
        "emoji prompt": (["--prompt", "🎉" * 5], 0),
        "prompt past the context": (["--prompt", "word " * 200], 2),
        "-n 0": (["-n", "0"], 2),
        "--max-tokens 0": (["--max-tokens", "0"], 2),
        "--max-tokens huge": (["--max-tokens", str(10**12)], 0),
        "--top-k -1": (["--top-k", "-1"], 2),
        "--top-k huge": (["--top-k", str(10**9)], 0),
        "temperature nan": (["--temperature", "nan"], 2),
        "temperature inf": (["--temperature", "inf"], 2),
        "temperature -0": (["--temperature", "-0.0"], 0),
        "temperature tiny": (["--temperature", "1e-320"], 0),
        "seed -1": (["--seed", "-1"], None),
        "seed 2**64": (["--seed", str(2**64)], 2),
        "device meta": (["--device", "meta"], 2),
        "device cuda": (["--device", "cuda"], 2),
        "device cpu:0": (["--device", "cpu:0"], 0),
        "device empty": (["--device", ""], 2),
        "data not a folder": (["--data", work / "afile"], 1),
        "data other vocab": (["--data", work], 1),
    }
    (work / "afile").write_text("x")
    for name, (args, code) in cases.items():
        trial(f"sample: {name}", ["sample", run, "--max-tokens", "3", *args], code)
    ckpt = run / "checkpoints" / "step_000004"
    for name, file, change in (
        ("weights truncated", "model.safetensors", lambda b: b[:100]),
        ("weights removed", "model.safetensors", None),
        ("manifest garbage", "manifest.json", lambda b: b"{"),
        (
            "config vocab edited",
            "config.json",
            lambda b: b.replace(b'"vocab_size": 512', b'"vocab_size": 600'),
        ),
    ):
        copy = work / "ck" / name.replace(" ", "_")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(ckpt, copy)
        (copy / file).unlink() if change is None else (copy / file).write_bytes(
            change((copy / file).read_bytes())
        )
        trial(f"sample: checkpoint {name}", ["sample", copy, "--max-tokens", "3"], 1)


def cli_trials(data: Path, work: Path) -> None:
    t = ["train", "--dry-run", *TINY, f"data.dir={data}"]
    for override, code in (
        ("model.n_layer = 2", None), ("=", 2), ("model.n_layer==2", 2), ("model..n_layer=2", 2),
        ("model.n_layer=2 ", 0), ("model.n_layer=0x10", 2), ("model.n_layer=1_0", None), ("model.n_layer=+2", None),
        ("model.n_layer=2.0", 2), ("model.n_layer=true", 2), ("train.steps=-1", 2), ("train.steps=0", 2),
        ("model.n_layer=10000000000", 2), ("train.stages=", 0), ("data.max_doc_len=-1", 2),
        ("model.yarn=maybe", 2), ("train.val_every=-5", 2), ("train.seed=-1", None), ("optim.tie_until=-2", 2),
    ):  # fmt: skip
        trial(f"cli: {override!r}", [*t, override], code)
    toml = work / "r.toml"
    for name, text, code in (
        ("BOM", '\ufeffbase = "demo"\n', None),
        ("self base", f'base = "{toml}"\n', 2),
        ("unknown base", 'base = "nope"\n', 2),
        ("bad TOML", "base = \n", 2),
        ("stages a number", 'base = "stages-2025-12"\n[train]\nstages = 5\n', 2),
        ("unknown table", 'base = "demo"\n[warp]\nx = 1\n', 2),
    ):
        toml.write_text(text, encoding="utf-8")
        trial(f"recipe file: {name}", ["train", "--dry-run", "--recipe", toml, *TINY], code)
    trial("cli: --recipe empty", ["train", "--dry-run", "--recipe", ""], 2)
    trial("cli: --recipe a folder", ["train", "--dry-run", "--recipe", work], 2)
    trial("cli: --dry-run with --resume", ["train", "--dry-run", "--resume", work / "demo-run"], None)
    trial("cli: compare a file", ["compare", work / "afile"], 1)
    for source, extra, code in (
        ("text:", [], 2), (f"text:{work / 'missing.txt'}", [], None), ("wiki-vital:3", [], 2),
        ("fineweb10B:0", [], 2), ("fineweb10B:-1", [], 2), ("fineweb10B:abc", [], 2),
        ("wiki-vital", ["--tokenizer", "bpe:0"], 2), ("wiki-vital", ["--tokenizer", "bpe:70000"], 2),
        ("wiki-vital", ["--tokenizer", "bpe:abc"], 2), ("wiki-vital", ["--workers", "0"], 2),
        ("wiki-vital", ["--max-tokens", "0"], 2), ("wiki-vital", ["--tokenizer", "gpt2 "], 2),
    ):  # fmt: skip
        trial(
            f"prepare: {source} {' '.join(extra)}",
            ["prepare", source, *extra, "--data-dir", work / "p"],
            code,
        )
    run = finished_run(data, work)
    for args, code in (
        (["--tokens", "0"], 2),
        (["--tokens", "7"], 2),
        (["--limit", "3"], 2),
        (["--data", work], 1),
    ):
        trial(f"eval: {' '.join(map(str, args))}", ["eval", run, *args], code)
    for args, code in ((["--steps", "0"], 2), (["--warmup", "-1"], 2)):
        trial(f"bench: {' '.join(args)}", ["bench", *args, *TINY], code)


GROUPS = [stage_plan_trials, verify_trials, ablate_trials, sample_trials, cli_trials]
