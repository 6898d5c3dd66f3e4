"""The one runner of tests/e2e/runs.py's definitions: it builds `speedrun train`'s command line from a
definition and runs it the one way: in this process for 1 process (`speedrun.cli.main`, what `python -m
speedrun` runs; a child process where the definition says `child`), in the suite's one torchrun launch for 2
(tests/two_processes.py), under a torchrun of its own for more. `trained(name)` runs a definition once per
pytest-xdist worker and hands every later caller the same folder; tests that read it carry `uses(name)`, its
xdist group, so that it trains once in the suite.

    RUNS = runner.uses("resumable", "resumable-2")   # at import: the mark; registers 2-process runs

    @RUNS
    def test_x(trained):
        one, two = trained("resumable"), trained("resumable-2")
"""

from __future__ import annotations

import functools
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import two_processes
from tests.conftest import read_metrics, run_speedrun, speedrun_command, tiny_for
from tests.e2e.runs import RUNS, Run

TORCHRUN_TIMEOUT_S = 1500  # on a loaded 2-core host, 4 processes start up (imports, MFU probe) in ~400 s


@dataclass
class Result:
    """What a run left: its folder (with seeds, `folders` holds the siblings), exit code and output."""

    folder: Path
    code: int | None
    stdout: str = ""
    stderr: str = ""
    folders: list[Path] = field(default_factory=list)

    @property
    def metrics(self) -> list[dict]:
        return read_metrics(self.folder)

    @property
    def summary(self) -> dict:
        return json.loads((self.folder / "summary.json").read_text())

    @property
    def log(self) -> str:
        return (self.folder / "log.txt").read_text()


def shrink(run: Run) -> list[str]:
    """The overrides that make `run.recipe` seconds on a CPU, before the definition's own."""
    if run.shrink == "tiny":
        return list(tiny_for(run.recipe))
    if run.shrink == "matrix":  # every switch the recipe sets, at recipe_matrix's size
        from tests.recipe_matrix import shrink as matrix

        return [a for a in matrix(run.recipe) if not a.startswith(("model.vocab_size=", "model.eot_id="))]
    assert run.shrink == "none", run.shrink
    return []


def overrides(run: Run, data: Path) -> list[str]:
    """The definition's key=value settings: the shrink, the test dataset, its own overrides."""
    eot = json.loads((data / "meta.json").read_text())["eot_id"]
    return [*shrink(run), f"data.dir={data}", *(o.format(data=data, eot=eot) for o in run.overrides)]


def arguments(run: Run, data: Path) -> list[str]:
    """`speedrun train`'s arguments after `--out DIR`: the recipe, seeds and settings."""
    seeds = ["--seeds", ",".join(map(str, run.seeds))] if run.seeds else []
    return ["--recipe", run.recipe, *seeds, *overrides(run, data)]


def config(name: str, data: Path, *extra: str):
    """The resolved config of definition `name` (with `extra` overrides): for a test that calls the loop
    itself (under a patch), on the run a definition describes."""
    from speedrun.recipes import load_recipe

    return load_recipe(RUNS[name].recipe, [*overrides(RUNS[name], data), *extra])


def command(run: Run, out: Path, data: Path, *extra: str) -> list[str]:
    """The full command line after `speedrun` (or `torchrun -m speedrun`)."""
    return ["train", "--out", str(out), *arguments(run, data), *extra]


def launch_command(name: str, out: Path, data: Path, *extra: str) -> list[str]:
    """The whole command line of definition `name` (`python -m speedrun ...`, or torchrun's with its
    processes): for a test that starts it itself (to signal or kill it)."""
    run = RUNS[name]
    return speedrun_command(*command(run, out, data, *extra), nproc=run.processes if run.processes > 1 else 0)


def cli(*args: str, processes: int = 1, child: bool = False) -> subprocess.CompletedProcess:
    """`speedrun ARGS` the one way: in this process, a child process, or torchrun with `processes`."""
    if processes > 1:
        cmd = speedrun_command(*args, nproc=processes)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
    return run_speedrun(*args, subprocess_=child)


def execute(name: str, out: Path, data: Path, *extra: str) -> Result:
    """Run definition `name` into the new folder `out` (with `extra` overrides after its own): for a test
    that changes the run (a kill, a damaged file), where the cached one must stay as it is."""
    run = RUNS[name]
    proc = cli(*command(run, out, data, *extra), processes=run.processes, child=run.child)
    folders = [out.with_name(f"{out.name}-seed{s}") for s in run.seeds]
    return Result(out, proc.returncode, proc.stdout, proc.stderr, folders)


def resume(folder: Path, *overrides: str, processes: int = 1) -> Result:
    """`speedrun train --resume FOLDER OVERRIDES`, on `processes` (in this process for 1)."""
    proc = cli("train", "--resume", str(folder), *overrides, processes=processes)
    return Result(folder, proc.returncode, proc.stdout, proc.stderr)


def uses(*names: str) -> pytest.MarkDecorator:
    """The xdist group of tests that read the runs `names` (one group: they train once in the suite);
    registers each 2-process one with the suite's torchrun launch. Call at import."""
    groups = {RUNS[n].xdist_group for n in names}
    assert len(groups) == 1, f"{names} belong to the groups {groups}: give them one"
    for name in names:
        if RUNS[name].processes == 2:
            two_processes.job(name, functools.partial(arguments, RUNS[name]))
    return pytest.mark.xdist_group(groups.pop())


_DONE: dict[str, Result] = {}  # per pytest-xdist worker (one process each): name -> its result


def trained(name: str, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Result:
    """Definition `name`, trained once in this worker; fails the test unless it finished with exit 0."""
    run = RUNS[name]
    if name not in _DONE:
        if run.processes == 2:
            assert name in two_processes.JOBS, f"mark the test with runner.uses({name!r})"
            folder = two_processes.run_dir(name, data, tmp_path_factory)
            _DONE[name] = Result(folder, 0)
        else:
            out = tmp_path_factory.getbasetemp() / "e2e-runs" / name / run.out
            out.parent.mkdir(parents=True, exist_ok=True)
            _DONE[name] = execute(name, out, data)
    result = _DONE[name]
    assert result.code == 0, (name, result.stderr[-3000:])
    return result
