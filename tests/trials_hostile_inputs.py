"""Hostile but fair trials of issue 46's walk, as run: each command, what it got, and a verdict, so the count
in docs/bad-inputs.md ("Issue 46 — a walk over the fault classes") is honest.

    PYTHONPATH=src python -m tests.trials_hostile_inputs DATA_DIR RUN_DIR WORK_DIR > table.md

DATA_DIR: a bpe:512 folder (tests/conftest.py's text_data); RUN_DIR: a finished tiny run on it. Each trial
runs the CLI in a child process (30 s at most: a trial that would train is cut, and that is a fault). A
trial passes when the exit code is the expected one and a failure is one stderr line without a traceback.
Not collected by pytest: the classes it found have their own tests (docs/bad-inputs.md names them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.max_seq_len=64",
        "model.vocab_size=512", "data.tokenizer=bpe:512", "train.seq_len=64", "train.micro_batch_tokens=512",
        "train.global_batch_tokens=1024", "train.compile=off", "train.dtype=fp32",
        "train.val_tokens=2048"]  # fmt: skip


DRY = ["train", "--dry-run"]


def dry(recipe: str, *overrides: str) -> list[str]:
    return [*DRY, "--recipe", recipe, *overrides]


def run(argv: list[str], cwd: Path) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        p = subprocess.run([sys.executable, "-m", "speedrun", *argv], capture_output=True, text=True,
                           timeout=30, cwd=cwd, env=env)  # fmt: skip
    except subprocess.TimeoutExpired:
        return -1, "(still running after 30 s: cut)"
    return p.returncode, p.stderr.strip()


def trials(data: Path, done: Path, work: Path) -> list[tuple[list[str], int]]:
    d = f"data.dir={data}"
    files = {
        "dup.toml": 'base = "demo-2026"\n[model]\nattn_scale = 0.10\n[model.attn]\nscale = 0.12\n',
        "dup2.toml": (
            'base = "bos-align-2025-07"\n[model]\nlogit_softcap = 10.0\n[model.head]\nsoftcap = 12.0\n'
        ),
        "empty.toml": "",
        "self.toml": 'base = "self.toml"\n',
        "nobase.toml": 'base = "no-such-recipe"\n',
        "section.toml": 'base = "demo"\n[modle]\nn_layer = 2\n',
        "part.toml": 'base = "demo-2026"\n[model.attnx]\nscale = 0.1\n',
        "listint.toml": 'base = "demo"\n[model]\nn_layer = [2]\n',
        "top.toml": 'base = "demo"\nsteps = 5\n',
        "subkey.toml": 'base = "demo-2026"\n[model.attn]\nwindow_unit = 64\n',
        "family.toml": 'base = "demo"\n[model]\nfamily = "gpt2026"\n',
        "bool.toml": 'base = "demo"\n[train]\nsteps = true\n',
        "float.toml": 'base = "demo"\n[train]\nsteps = 5.5\n',
        "huge.toml": 'base = "demo"\n[train]\nsteps = 99999999999999999999\n',
    }
    for name, text in files.items():
        (work / name).write_text(text)
    (work / "afile").write_text("x")
    (work / "emptydir").mkdir(exist_ok=True)
    t: list[tuple[list[str], int]] = [
        # a setting accepted and ignored: two spellings, gpt2026 sub-keys with their switch off
        (dry(str(work / "dup.toml")), 2),
        (dry(str(work / "dup2.toml")), 2),
        (dry("demo-2026", "model.attn_scale=0.1", "model.attn.scale=0.12"), 2),
        (dry("demo-2026", "model.attn.scale=0.1", "model.attn.scale=0.12"), 0),
        (dry("bos-align-2025-07", "model.logit_softcap=10", "model.head.softcap=12"), 2),
        (dry(str(work / "subkey.toml")), 2),
        (dry("demo-2026", "model.attn.window_unit=64"), 2),
        (dry("demo-2026", "model.attn.window_warmup_start=32"), 2),
        (dry("demo-2026", "model.attn.window_unit=128"), 0),
        (dry("bos-align-2025-07", "model.head.softcap=0", "model.head.softcap_divisor=2"), 2),
        (dry("bos-align-2025-07", "model.head.softcap=0", "model.head.softcap_in_bf16=true"), 2),
        (dry("demo-2026", "model.ngram.sign_rows=4096"), 2),
        (dry("demo-2026", "model.ngram.dim=128"), 2),
        (dry("demo-2026", "model.ngram.dtype=fp32"), 2),
        (
            dry("demo-2026", "model.ngram.rows=4096", "model.ngram.dtype=fp32"),
            2,
        ),  # + bigram rows
        (
            dry(
                "demo-2026",
                "model.skips=[]",
                "model.stream.skip_gate=0",
                "model.stream.skip_gate_form=sigmoid",
            ),
            2,
        ),
        (dry("demo-2026", "model.attn.narrow_scale=0.2"), 2),
        (dry("demo", "optim.tail_ema_start=5"), 2),
        (dry("demo", "model.window_unit=32"), 2),
        # refusals: the cause and a remedy that works
        (dry("demo-2026", "optim.gate_lr_mul=0"), 2),
        (dry("demo-2026", "optim.gate_lr_mul=-1"), 2),
        (dry("demo-2026", "optim.gate_lr_mul=0.5"), 2),
        (dry("demo", "train.time_budget_s=1", "train.steps=5"), 2),
        (dry("demo-2026", "train.time_budget_s=1", "train.steps=5"), 2),
        (dry("demo", "train.time_budget_s=1", "train.steps=12"), 0),
        (["race", "--recipe", "demo", "--out", str(work / "r1"), "model.unet=true"], 2),
        (
            [
                "race",
                "--recipe",
                "demo",
                "--out",
                str(work / "r2"),
                "--set",
                "train.steps=6",
                "model.unet=true",
            ],
            2,
        ),
        (["race", "--recipe", "demo", "--out", str(work / "r3"), "--pairs", "0", "model.unet=true"], 2),
        (["race", "--recipe", "demo", "--out", str(work / "r4"), "--pairs", "-1", "model.unet=true"], 2),
        (
            [
                "race",
                "--recipe",
                "demo",
                "--out",
                str(work / "r5"),
                "--python-b",
                "/no/python",
                "model.unet=true",
            ],
            2,
        ),
        (["race", "--recipe", "demo", "--out", str(work / "afile"), "model.unet=true"], 2),
        (["race", "--recipe", "demo", "--out", str(work / "r6")], 2),
        # ablate arms that are not what their label says
        (["ablate", "--recipe", "demo", "--out", str(work / "a1"), "model.n_layer=4+model.unet=true"], 2),
        (["ablate", "--recipe", "demo", "--out", str(work / "a2"), "model.n_layer=2+n_head=1"], 2),
        (["ablate", "--recipe", "demo", "--out", str(work / "a3"), "model.n_layer=2+model.n_head"], 2),
        (["ablate", "--recipe", "demo", "--out", str(work / "a4"), "model.n_layer=2,model.n_head=2"], 2),
        (
            [
                "ablate",
                "--recipe",
                "demo",
                "--out",
                str(work / "a5"),
                "model.unet=true+data.source=wiki-vital",
            ],
            2,
        ),
        (["ablate", "--recipe", "demo", "--out", str(work / "a6"), "model.n_layer=4"], 2),
        (["ablate", "--recipe", "demo", "--out", str(work / "a7"), "train.log_every=3"], 2),
        (["ablate", "--recipe", "demo", "--out", str(work / "a8"), "model.unet"], 2),
        (["ablate", "--recipe", "demo", "--out", str(work / "a9"), "=true"], 2),
        (["ablate", "--recipe", "demo", "--out", str(work / "a10"), "--seeds", "0", "model.unet=true"], 2),
        (["ablate", "--recipe", "demo", "--out", str(work / "a11"), "--seeds", "1,1", "model.unet=true"], 2),
        (["ablate", "--recipe", "demo", "--out", str(work / "a12"), "model.unet=true", "model.unet=true"], 2),
        (["ablate", "--recipe", "demo", "--out", str(work / "a13"), "model.unet=true+train.seed=3"], 2),
        (["ablate", "--recipe", "demo", "--out", str(work / "a14"), "model.nope=1"], 2),
        (["ablate", "--recipe", "demo", "--out", str(work / "a15"), "model.unet=maybe"], 2),
        (["ablate", "--recipe", "nope", "--out", str(work / "a16"), "model.unet=true"], 2),
        (["noise", "--recipe", "demo", "--out", str(work / "n1"), "--seeds", "0"], 2),
        (["noise", "--recipe", "nope", "--out", str(work / "n2")], 2),
        # config values at and past their edges
        ([*DRY, "model.n_layer=0"], 2),
        ([*DRY, "model.n_layer=-1"], 2),
        ([*DRY, "model.n_layer=4.0"], 2),
        ([*DRY, "model.n_layer=true"], 2),
        ([*DRY, "model.n_layer="], 2),
        ([*DRY, "model.n_layer"], 2),
        ([*DRY, "=4"], 2),
        ([*DRY, "model.=4"], 2),
        ([*DRY, "model..n_layer=4"], 2),
        ([*DRY, "train.steps=0"], 2),
        ([*DRY, "train.steps=1e3"], 2),
        ([*DRY, "train.seq_len=63"], 2),
        ([*DRY, "optim.muon_lr=nan"], 2),
        ([*DRY, "optim.muon_lr=inf"], 2),
        ([*DRY, "optim.muon_lr=-0.1"], 2),
        ([*DRY, "optim.betas=[0.9]"], 2),
        ([*DRY, "optim.betas=[0.9,1.0]"], 2),
        ([*DRY, "optim.eps=0"], 2),
        ([*DRY, "data.tokenizer=bpe:0"], 2),
        ([*DRY, "data.tokenizer=bpe:99999999"], 2),
        ([*DRY, "data.tokenizer=gpt4"], 2),
        ([*DRY, "train.seed=-1"], 2),
        ([*DRY, "train.seed=99999999999999999999"], 2),
        ([*DRY, "train.warmdown_frac=1.5"], 2),
        ([*DRY, "train.warmdown_steps=5", "train.warmdown_frac=0.2"], 2),
        ([*DRY, "model.window=-5"], 2),
        ([*DRY, "model.window_pattern=LX"], 2),
        (dry("demo-2026", "model.attention_layers=[99]"), 2),
        (dry("demo-2026", "model.skips=[[3,1]]"), 2),
        (dry("demo-2026", "model.attn.qk_head_dim=6"), 2),
        (dry("demo-2026", "model.head.sampled_stride=2"), 2),
        (dry("demo-2026", "model.ngram.rows=-1"), 2),
        (dry("demo-2026", "model.windows=L,L"), 2),
        (dry("demo-2026", "model.family=gpt2024"), 2),
        (dry("demo", "model.family=gpt2026"), 2),
        ([*DRY, "train.stages=bogus"], 2),
        ([*DRY, "description=x\ny"], 0),
        ([*DRY, "optim.name=sgd"], 2),
        ([*DRY, "optim.labels.nope.lr=1"], 2),
        ([*DRY, "train.device=cuda:7"], 2),
        ([*DRY, "train.device=tpu"], 2),
        # recipe files
        (dry(str(work / "empty.toml")), 0),
        (dry(str(work / "self.toml")), 2),
        (dry(str(work / "nobase.toml")), 2),
        (dry(str(work / "section.toml")), 2),
        (dry(str(work / "part.toml")), 2),
        (dry(str(work / "listint.toml")), 2),
        (dry(str(work / "top.toml")), 2),
        (dry(str(work / "family.toml")), 2),
        (dry(str(work / "bool.toml")), 2),
        (dry(str(work / "float.toml")), 2),
        (dry(str(work / "huge.toml")), 2),
        (dry(str(work / "emptydir")), 2),
        (dry(str(work / "afile")), 2),
        (dry(""), 2),
        # train's options and run folders
        (["train", "--resume", str(work / "nope")], 2),
        (["train", "--resume", str(work / "afile")], 2),
        (["train", "--resume", str(work / "emptydir")], 2),
        (["train", "--resume", str(done), "--out", "x"], 2),
        (["train", "--resume", str(done), "train.steps=3"], 2),
        (["train", "--resume", str(done / "checkpoints")], 2),
        (["train", "--seeds", "0", "--dry-run"], 0),
        (["train", "--seeds", "1,1", "--dry-run"], 2),
        (["train", "--seeds", "a", "--dry-run"], 2),
        (["train", "--seeds", "1,2", "--resume", str(done)], 2),
        (["train", "--seeds", "1,2", "--out", "/", d, *TINY], 2),
        (["train", "--seeds", "1,2", "--out", str(work / "s"), "train.seed=3", d, *TINY], 2),
        (["train", "--out", str(done), d, *TINY], 2),
        (["train", "--out", str(work / "afile"), d, *TINY], 2),
        (["train", "--bogus"], 2),
        # tools on run folders
        (["compare"], 2),
        (["compare", str(work / "nope")], 1),
        (["compare", str(work / "afile")], 1),
        (["compare", str(work / "emptydir")], 1),
        (["compare", str(done), str(done)], 0),
        (["compare", str(done), "--target", "nan"], 2),
        (["compare", str(done), "--plot", str(done / "log.txt")], 2),
        (["verify", str(work / "emptydir")], 1),
        (["verify", str(done), "--target", "inf"], 2),
        (["verify", str(done), "--baseline", str(done)], 2),
        (["sample", str(done), "--tokens", "-1"], 2),
        (["sample", str(work / "nope")], 1),
        (["sample", str(done), "--temperature", "nan"], 2),
        (["eval", str(work / "emptydir")], 1),
        # data
        (["prepare", "nope"], 2),
        (["prepare", f"text:{work / 'nope.txt'}", "--data-dir", str(work / "p1")], 1),
        (["prepare", "wiki-vital", "--tokenizer", "bpe:1", "--data-dir", str(work / "p2")], 2),
        (["prepare", "wiki-vital", "--tokenizer", "gpt4", "--data-dir", str(work / "p3")], 2),
        (["prepare", f"text:{work / 'emptydir'}", "--data-dir", str(work / "p4")], 1),
        (["prepare", "wiki-vital", "--data-dir", str(work / "afile")], 1),
        (["prepare", "fineweb10B:0", "--data-dir", str(work / "p5")], 2),
        (["prepare", "fineweb10B:x", "--data-dir", str(work / "p6")], 2),
        (["recipes", "--bogus"], 2),
        (["bench", "--steps", "0"], 2),
    ]
    return t


def main() -> None:
    data, done, work = (Path(a).resolve() for a in sys.argv[1:4])
    work.mkdir(parents=True, exist_ok=True)
    rows, faults = [], 0
    for argv, want in trials(data, done, work):
        code, err = run(argv, work)
        lines = err.splitlines()
        last = lines[-1] if lines else ""
        bad = code != want or "Traceback" in err or (code not in (0,) and len(lines) != 1)
        faults += bad
        shown = (
            " ".join(a if len(a) < 60 else "…" + a[-40:] for a in argv)
            .replace("\n", "\\n")
            .replace(str(work) + "/", "")
        )
        got = last.removeprefix("speedrun: error: ").replace(str(work) + "/", "").replace("|", "\\|")
        rows.append(f"| `{shown.replace('|', '/')}` | {code}: {got[:220] or '(nothing on stderr)'} | "
                    f"{'FAULT' if bad else 'ok'} |")  # fmt: skip
        print(rows[-1], flush=True)
    print(f"\n{len(rows)} trials, {faults} faults", flush=True)
    json.dumps(rows)


if __name__ == "__main__":
    main()
