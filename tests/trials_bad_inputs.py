"""The fifth adversarial round (issue 27), as run: every trial and its outcome, so the count is honest.

    PYTHONPATH=src python -m tests.trials_bad_inputs DATA_DIR WORK_DIR [NAME_FILTER]

DATA_DIR: a bpe:512 folder (`speedrun prepare wiki-vital --tokenizer bpe:512 --max-tokens 300000`).
Each trial calls the CLI in this process and passes when: no exception escapes `main` (a traceback),
a failure is one stderr line, and the exit code and words are the expected ones; some trials compare
numbers (a resumed run's losses with the uninterrupted run's). Not collected by pytest: the faults
found have their own tests (the tests/test_bad_inputs_*.py files named in docs/bad-inputs.md).

The last full run (2026-11-25): 266 trials, 0 faults. Before their fixes the trials found 6 faults:
an ablation switch that changes only reporting (trained the baseline twice), a checkpoint folder
missing its weights called "the run has no checkpoint", `model.n_layer=10^10` blamed on
max_seq_len, `--recipe FOLDER` "not found", a run folder whose lock file is a folder not named,
and verify judging an impossible `starts` list (the per-start facts added in this issue). The
other first-run mismatches were the trials' own expectations (a resumed run logs other steps;
`tokens=500` rows are valid under varlen; a copied run as --baseline is refused as a copy: 2).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from speedrun.cli import main
from tests.recipe_matrix import shrink

UNTIE = ["model.tie_embeddings=false", "model.zero_init_head=false", "model.pad_embeddings=true",
         "model.embed_dtype=fp32"]  # fmt: skip
RESULTS: list[tuple[str, str, str]] = []  # (trial, "ok" | "FAULT", what happened)


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0
        except BaseException:  # noqa: BLE001 - a traceback is what the trial looks for
            return -1, out.getvalue(), traceback.format_exc()
    return code, out.getvalue(), err.getvalue()


def trial(name: str, argv: list, code: int | None = None, words: tuple[str, ...] = (),
          check: Callable[[int, str, str], str | None] | None = None) -> tuple[int, str, str]:  # fmt: skip
    got, out, err = cli(*argv)
    lines = err.strip().splitlines()
    problem = None
    if got == -1:
        problem = "traceback: " + lines[-1][:200]
    elif got == 1 and not err.strip() and "not accepted" in out:  # verify's verdict: shown below
        lines = [x for x in out.splitlines() if ": " in x and not x.split()[1].startswith("ok")][:3]
    elif got != 0 and (len([x for x in lines if x.startswith("speedrun")]) != 1 or "Traceback" in err):
        problem = f"exit {got} without one error line: {err.strip()[-300:]!r}"
    elif code is not None and got != code:
        problem = f"exit {got}, expected {code}: {(lines or [''])[-1][:200]}"
    elif missing := [w for w in words if w not in err + out]:
        problem = f"missing {missing}: {(lines or [''])[-1][:200]}"
    elif check is not None:
        problem = check(got, out, err)
    RESULTS.append(
        (name, "FAULT" if problem else "ok", problem or " | ".join(lines[-3:] or ["exit 0"])[:300])
    )
    return got, out, err


def tiny(recipe: str, data: Path, *extra: str) -> list[str]:
    """The recipe shrunk as the recipe matrix shrinks it, on DATA_DIR, 10 steps, no budget."""
    return [*shrink(recipe), f"data.dir={data}", "data.tokenizer=bpe:512", "train.val_tokens=2048",
            "train.time_budget_s=0", "train.budget_min_steps=0", "train.val_every=0", *extra]  # fmt: skip


def losses(run: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in rows]


def same_losses(a: Path, b: Path) -> Callable[[int, str, str], str | None]:
    def check(code: int, out: str, err: str) -> str | None:
        if code != 0:
            return f"exit {code}"
        la, lb = (
            dict(((s, t is None), (t, v)) for s, t, v in losses(a)),
            dict(((s, t is None), (t, v)) for s, t, v in losses(b)),
        )  # the resumed run logs other steps (its first step is a log point): compare the common ones
        diff = [(k, la[k], lb[k]) for k in la.keys() & lb.keys() if la[k] != lb[k]]
        if len(la.keys() & lb.keys()) < 3 or diff:
            return f"resumed losses differ: {sorted(diff)[:3]}"
        return None

    return check


def rewound(run: Path, copy: Path, step: int) -> Path:
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run, copy)
    for ckpt in (copy / "checkpoints").iterdir():
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)
    (copy / "summary.json").unlink(missing_ok=True)
    return copy


def resume_trials(data: Path, work: Path) -> None:
    """2025 recipes: resume across a stage change and across the untie gives the uninterrupted run."""
    cases = {
        "stages-2025-12 across a stage change": ("stages-2025-12", ["optim.tie_until=0"], 6),
        "stages-2025-12 across the untie": ("stages-2025-12", ["optim.tie_until=4", "optim.adam_every=2"], 6),
        "stages-2025-12 at the untie step": (
            "stages-2025-12",
            ["optim.tie_until=4", "optim.adam_every=2"],
            4,
        ),
        "normuon-2025-10 across the untie": ("normuon-2025-10", [*UNTIE, "optim.tie_until=4"], 6),
        "normuon-2025-10 at step 2": ("normuon-2025-10", [], 2),
        "yarn-2025-09 mid-run": ("yarn-2025-09", [], 4),
        "polar-2025-09 mid-run": ("polar-2025-09", [], 6),
        "bos-align-2025-07 mid-run": ("bos-align-2025-07", [], 4),
    }
    for name, (recipe, extra, at) in cases.items():
        run = work / f"straight-{recipe}-{'-'.join(extra) or 'plain'}"
        if not (run / "summary.json").is_file():
            shutil.rmtree(run, ignore_errors=True)
            ckpt = ["train.checkpoint_every=2", "train.checkpoint_keep=0", "train.checkpoint_at_end=true"]
            code, _, err = cli("train", "--recipe", recipe, "--out", run, *tiny(recipe, data, *extra, *ckpt))
            if code != 0:
                RESULTS.append((f"resume: {name} (straight run)", "FAULT", err.strip()[-300:]))
                continue
        copy = rewound(run, work / "resumed", at)
        trial(f"resume: {name}", ["train", "--resume", copy], 0, check=same_losses(copy, run))
        for args, words in (  # sample and eval of every such checkpoint
            (["sample", run, "--max-tokens", "5", "--temperature", "0"], ()),
            (["sample", run / "checkpoints" / f"step_{at:06d}", "--max-tokens", "5", "-n", "2"], ()),
            (["eval", run, "--tokens", "512"], ("val loss",)),
        ):
            trial(f"{args[0]}: {name} {Path(args[1]).name}", args, 0, words)


def main_trials(data: Path, work: Path, only: str = "") -> None:
    groups = [resume_trials]
    from tests import trials_bad_inputs_cases, trials_bad_inputs_files  # noqa: F401 (it adds its groups)

    groups += trials_bad_inputs_cases.GROUPS
    for group in groups:
        if only and only not in group.__name__:
            continue
        group(data, work)


if __name__ == "__main__":
    data_dir, work_dir = Path(sys.argv[1]), Path(sys.argv[2])
    work_dir.mkdir(parents=True, exist_ok=True)
    from tests import trials_bad_inputs as this  # the module the cases import (not __main__)

    this.main_trials(data_dir, work_dir, sys.argv[3] if len(sys.argv) > 3 else "")
    for name, status, what in this.RESULTS:
        print(f"{status:5} {name}: {what}")
    faults = sum(s == "FAULT" for _, s, _ in this.RESULTS)
    print(f"{len(this.RESULTS)} trials, {faults} fault(s)")
