"""The README a newcomer reads: short, its recipe table equal to `speedrun recipes`, every command it
shows accepted by the CLI's own parser (and a train or ablate command's overrides by the config layer),
every linked file present, the shown demo output named by CPU and commit, and its two set-up commands
the ones CI runs."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from speedrun.cli import _build_parser
from speedrun.recipes import DEFAULT_RECIPE, load_recipe
from speedrun.recipes.index import index_lines
from speedrun.tools.ablate import plan

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```$", README, flags=re.M | re.S)


def _commands() -> list[list[str]]:
    """The argv after `speedrun` (or `-m speedrun`) of every command in the README's bash blocks."""
    found = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if "speedrun" in words and (words[0] == "speedrun" or "-m" in words):
                    found.append(words[words.index("speedrun") + 1 :])
    return found


def test_it_is_short():
    assert len(README.splitlines()) <= 250


def test_the_recipe_table_is_the_index():
    marks = r"<!-- speedrun recipes: begin -->\n```text\n(.*?)```\n<!-- speedrun recipes: end -->"
    (table,) = re.findall(marks, README, flags=re.S)
    assert table.splitlines() == index_lines(), "paste the output of `speedrun recipes` into the README"


def test_every_command_shown_parses_and_its_overrides_load():
    commands = _commands()
    assert len(commands) >= 7 and ["train"] in commands  # the Quick start's, the next five, torchrun's
    parser = _build_parser()
    for argv in commands:
        args = parser.parse_args(argv)  # ConfigError (one line, exit 2) on anything it refuses
        if args.command == "train":
            load_recipe(args.recipe or DEFAULT_RECIPE, args.overrides)
        elif args.command == "ablate":
            plan(args.recipe, [1], args.set or [], args.switches, None)


def test_every_linked_file_exists():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if not link.startswith("http")]
    assert len(local) >= 10
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_the_demo_output_names_its_cpu_and_commit():
    before, block = re.search(
        r"((?:[^\n]+\n)+)\n```\n((?:compile|host fit): .*?)```", README, flags=re.S
    ).groups()
    assert re.search(r"\b(AVX2|AVX512-BF16|AMX|EPYC|Xeon)\b", before), "name the CPU the run came from"
    commits = re.findall(r"commit `([0-9a-f]{7,40})`", before)
    assert commits, "name the commit the run came from"
    assert re.search(r"^done: val loss \d\.\d{4}, val bpb \d\.\d{4} \| train time ", block, flags=re.M)
    if (ROOT / ".git").exists():
        known = subprocess.run(["git", "cat-file", "-e", f"{commits[0]}^{{commit}}"], cwd=ROOT)
        if known.returncode != 0:
            pytest.skip(f"commit {commits[0]} not in this clone (shallow?)")


def test_the_two_setup_commands_are_the_ones_ci_runs():
    install, test = _blocks("bash")[0].splitlines()[:2]
    assert test.split("#")[0].split() == ["pytest"]
    assert [line for line in CI.splitlines() if line and not line.startswith("#")][-1] == "pytest"
    for spec in ("torch==2.13.0", '-e ".[dev]"'):
        assert spec in install and spec in CI
