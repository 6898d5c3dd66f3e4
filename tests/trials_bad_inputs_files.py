# ruff: noqa: E501 (tables of trials read best one per line)
"""More of the fifth round's trials (tests/trials_bad_inputs.py runs them): odd files under --resume, numbers
(eval of every checkpoint of a staged run), outputs inside runs, checkpoints and data folders, and
stage plans that the dry run accepts, trained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import TINY
from tests.trials_bad_inputs import cli, tiny, trial
from tests.trials_bad_inputs_cases import FAST, GROUPS, finished_run


def file_trials(data: Path, work: Path) -> None:
    """Odd files under --resume."""
    run = finished_run(data, work)
    r = work / "res"

    def resumed(name: str, prepare) -> None:
        shutil.rmtree(r, ignore_errors=True)
        shutil.copytree(run, r)
        (r / "summary.json").unlink()
        prepare(r)
        trial(f"resume: {name}", ["train", "--resume", r], None)

    def cfg_edit(key, value):
        def edit(folder: Path) -> None:
            c = json.loads((folder / "config.json").read_text())
            c["model"][key] = value
            (folder / "config.json").write_text(json.dumps(c))

        return edit

    resumed("config n_layer edited", cfg_edit("n_layer", 3))
    resumed(
        "metrics torn", lambda f: (f / "metrics.jsonl").write_text((f / "metrics.jsonl").read_text() + '{"st')
    )
    resumed("stray step_abc", lambda f: (f / "checkpoints" / "step_abc").mkdir())
    resumed("stray step file", lambda f: (f / "checkpoints" / "step_000009").write_text("x"))
    resumed(
        "lock a folder",
        lambda f: ((f / ".speedrun.lock").unlink(missing_ok=True), (f / ".speedrun.lock").mkdir()),
    )
    resumed("summary a folder", lambda f: (f / "summary.json").mkdir())
    resumed("config.json array", lambda f: (f / "config.json").write_text("[]"))


def semantic_trials(data: Path, work: Path) -> None:
    """Numbers, not only exit codes: eval of every checkpoint of a staged run gives the loop's val loss
    at that step (its stage's windows and YaRN), and a resume under another plan is refused."""
    run = work / "staged-val"
    if not (run / "summary.json").is_file():
        shutil.rmtree(run, ignore_errors=True)
        extra = [
            "train.val_every=2",
            "train.checkpoint_every=2",
            "train.checkpoint_keep=0",
            "optim.tie_until=0",
        ]
        code, _, err = cli(
            "train", "--recipe", "stages-2025-12", "--out", run, *tiny("stages-2025-12", data), *extra
        )
        assert code == 0, err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    for ckpt in sorted((run / "checkpoints").iterdir()):
        step = int(ckpt.name.split("_")[1])

        def same(code: int, out: str, err: str, step=step) -> str | None:
            got = float(out.split("val loss ")[1].split()[0])
            return (
                None if abs(got - val[step]) < 1e-4 else f"eval {got:.4f}, the run's val loss {val[step]:.4f}"
            )

        trial(
            f"eval: staged checkpoint {step} = the run's val loss",
            ["eval", ckpt, "--tokens", "2048"],
            0,
            check=same,
        )
    copy = work / "staged-copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_000010")
    (copy / "summary.json").unlink()
    other = "train.stages=tokens=512 windows=1/1 frac=1/2; tokens=512 windows=1/1 frac=1/2; tokens=512 windows=1/2 ext=0"
    trial("resume: staged run under another plan", ["train", "--resume", copy, other], 2, ("train.stages",))
    trial("resume: staged run with val_every changed", ["train", "--resume", copy, "train.val_every=5"], 0)
    trial("verify: the staged run", ["verify", run, "--target", "9", "--track", "3"], 1)
    trial("compare: the staged run and its resumed copy", ["compare", run, copy], 0)


def more_trials(data: Path, work: Path) -> None:
    """Where outputs land (reports, runs, data folders inside one another) and odd companions."""
    run = finished_run(data, work)
    ckpt = run / "checkpoints" / "step_000004"

    def checkpoint_intact(code: int, out: str, err: str) -> str | None:
        from speedrun.train.run.checkpoint import verify_checkpoint

        problem = verify_checkpoint(ckpt)
        return None if problem is None else f"the checkpoint is now damaged: {problem}"

    trial(
        "verify: --json inside a checkpoint",
        ["verify", run, "--target", "9", "--json", ckpt / "r.json"],
        2,
        check=checkpoint_intact,
    )
    trial(
        "compare: --plot inside a checkpoint",
        ["compare", run, "--plot", ckpt / "p.png"],
        2,
        check=checkpoint_intact,
    )
    trial(
        "bench: --json inside a checkpoint",
        ["bench", "--steps", "1", "--warmup", "0", *TINY, "--json", ckpt / "b.json"],
        2,
        check=checkpoint_intact,
    )
    for f in ("r.json", "p.png", "b.json"):
        (ckpt / f).unlink(missing_ok=True)
    trial(
        "prepare: --data-dir a run", ["prepare", "wiki-vital", "--tokenizer", "bpe:300", "--data-dir", run], 1
    )
    trial(
        "prepare: --data-dir a checkpoint",
        ["prepare", "wiki-vital", "--tokenizer", "bpe:300", "--data-dir", ckpt],
        None,
    )
    trial("train: --out a data folder", ["train", "--out", data, *TINY, *FAST, f"data.dir={data}"], 2)
    trial("train: data.dir a run", ["train", "--out", work / "x1", *TINY, *FAST, f"data.dir={run}"], 1)
    trial("eval: --data a run", ["eval", run, "--data", run], 1)
    trial("eval: --tokens past the split", ["eval", run, "--tokens", str(64 * 10**6)], None)
    trial(
        "sample: prompt with the end-of-text text",
        ["sample", run, "--prompt", "<|endoftext|>", "--max-tokens", "3"],
        0,
    )
    trial("sample: -n 3 greedy", ["sample", run, "-n", "3", "--temperature", "0", "--max-tokens", "3"], 0)
    for name in ("stages-2025-12", "normuon-2025-10", "yarn-2025-09", "polar-2025-09", "nope"):
        trial(f"recipes: {name}", ["recipes", name], 2 if name == "nope" else 0)
    trial(
        "train: stages-2025-12 full size dry run",
        ["train", "--recipe", "stages-2025-12", "--dry-run"],
        0,
        ("params:",),
    )
    trial(
        "bench: stages-2025-12 shrunk",
        [
            "bench",
            "--recipe",
            "stages-2025-12",
            "--steps",
            "1",
            "--warmup",
            "0",
            *tiny("stages-2025-12", data)[:-6],
        ],
        None,
    )
    hs = work / "hs.jsonl"
    for name, text in (("empty", ""), ("not JSON", "{"), ("no endings", '{"ctx": "a"}\n')):
        hs.write_text(text)
        trial(f"eval --hellaswag: {name}", ["eval", run, "--hellaswag", hs], None)
    other = work / "other-data"  # other text, so another bpe:512 vocabulary under the same name
    if not (other / "meta.json").is_file():
        from speedrun.data.sources import iter_documents

        docs = [d for i, d in zip(range(2000), iter_documents("wiki-vital"), strict=False) if i >= 1500]
        (work / "other.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        cli("prepare", f"text:{work / 'other.jsonl'}", "--tokenizer", "bpe:512", "--data-dir", other)
    trial(
        "sample: --data a folder with another bpe:512",
        ["sample", run, "--data", other, "--max-tokens", "3"],
        1,
    )
    trial("eval: --data a folder with another bpe:512", ["eval", run, "--data", other], 1)
    moved = work / "moved-data"
    shutil.rmtree(moved, ignore_errors=True)
    shutil.copytree(data, moved)
    stopped = work / "stopped"
    shutil.rmtree(stopped, ignore_errors=True)
    shutil.copytree(run, stopped)
    (stopped / "summary.json").unlink()
    c = json.loads((stopped / "config.json").read_text())
    c["data"]["dir"] = str(other)
    (stopped / "config.json").write_text(json.dumps(c))
    trial("resume: data.dir edited to other data", ["train", "--resume", stopped], None)


def odd_file_trials(data: Path, work: Path) -> None:
    """Run files as other tools or editors leave them, read by every command that reads them."""
    run = finished_run(data, work)
    o = work / "odd"

    def json_edit(change):
        return lambda t: json.dumps(change(json.loads(t)))

    cases = {
        "config with an unknown key": (
            "config.json",
            json_edit(lambda c: {**c, "model": {**c["model"], "foo": 1}}),
        ),
        "config with a BOM": ("config.json", lambda t: "\ufeff" + t),
        "metrics with a NaN val loss": (
            "metrics.jsonl",
            lambda t: t.replace('"val_loss": ', '"val_loss": NaN, "x": ', 1),
        ),
        "metrics with a float step": ("metrics.jsonl", lambda t: t.replace('"step": 4,', '"step": 4.0,', 1)),
        "summary with a string loss": ("summary.json", json_edit(lambda s: {**s, "final_val_loss": "nan"})),
        "log not UTF-8": ("log.txt", lambda t: t + "\udcff"),
    }
    for name, (file, change) in cases.items():
        folder = o / name.replace(" ", "_")
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(run, folder)
        text = change((folder / file).read_text())
        (folder / file).write_bytes(text.encode("utf-8", "surrogateescape"))
        for command in (
            ["compare"],
            ["verify", "--target", "9"],
            ["sample", "--max-tokens", "2"],
            ["eval", "--tokens", "512"],
        ):
            trial(f"{command[0]}: {name}", [command[0], folder, *command[1:]], None)
    linked = o / "linked"
    shutil.rmtree(linked, ignore_errors=True)
    shutil.copytree(run, linked, ignore=shutil.ignore_patterns("checkpoints"))
    (linked / "checkpoints").mkdir()
    (linked / "checkpoints" / "step_000004").symlink_to(run / "checkpoints" / "step_000004")
    (linked / "summary.json").unlink()
    trial("resume: a checkpoint that is a link to another run's", ["train", "--resume", linked], None)
    trial("sample: a run whose checkpoint is a link", ["sample", linked, "--max-tokens", "2"], None)


def stage_training_trials(data: Path, work: Path) -> None:
    """Plans the dry run accepts, trained (3 steps each): what the dry run accepts must also run."""
    ext = "tokens=512 windows=1/2 ext=0"
    for name, plan in {
        "windows past the positions": f"tokens=512 windows=1/9 frac=1; {ext}",
        "doc 0": f"tokens=512 windows=1/1 frac=1 doc=0; {ext}",
        "val 0": f"tokens=512 windows=1/1 frac=1; {ext} val=0",
        "rows of 250 tokens": f"tokens=500 windows=1/1 frac=1; {ext}",
        "a 2-step extension": "tokens=512 windows=1/1 frac=1; tokens=512 windows=1/2 ext=2",
    }.items():
        out = work / "st" / name.replace(" ", "_")
        shutil.rmtree(out, ignore_errors=True)
        extra = [f"train.stages={plan}", "train.steps=4", "train.checkpoint_at_end=true"]
        trial(
            f"stages trained: {name}",
            ["train", "--recipe", "stages-2025-12", "--out", out, *tiny("stages-2025-12", data), *extra],
            0,
        )
        trial(f"sample: stages {name}", ["sample", out, "--max-tokens", "2"], 0)


GROUPS += [file_trials, semantic_trials, more_trials, odd_file_trials, stage_training_trials]
