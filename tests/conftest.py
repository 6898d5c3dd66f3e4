"""Shared fixtures: a tiny prepared dataset and the overrides that shrink any recipe to seconds on CPU."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# One thread per process: tests run beside other processes on 2 cores, and oversubscribed OpenMP
# threads make torch many times slower. Child processes (CLI, torchrun) inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")

TINY = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "model.max_seq_len=64",
    "model.vocab_size=512",
    "data.tokenizer=bpe:512",
    "train.seq_len=64",
    "train.micro_batch_tokens=512",
    "train.global_batch_tokens=1024",
    "train.steps=30",
    "train.warmdown_steps=10",
    "train.val_every=10",
    "train.val_tokens=2048",
    "train.timing_warmup_steps=2",
    "optim.muon_lr=0.05",
    "optim.embed_lr=0.1",
    "optim.head_lr=0.02",
    "train.compile=off",  # the demo compiles; tiny test runs would spend their time compiling
    "train.dtype=fp32",  # tests of logic, not bf16 rounding: fast on every CPU (bf16 is ~100x slower on AVX2)
    "train.time_budget_s=0",  # exactly train.steps, whatever the host (the demo fits a time budget)
    "train.budget_min_steps=0",
]
# optim.name=adamw recipes: one AdamW reads no Muon/Adam-group LRs, and refuses them given (issue 35)
TINY_ADAMW = [o for o in TINY if not o.startswith("optim.")]


def tiny_for(recipe: str) -> list[str]:
    """TINY for the recipe's optimizer."""
    from speedrun.recipes import load_recipe

    return TINY_ADAMW if load_recipe(recipe).optim.name == "adamw" else TINY


@pytest.fixture(scope="session")
def text_data(tmp_path_factory) -> Path:
    """A small bpe:512 dataset prepared from a slice of the bundled corpus written as a .jsonl file."""
    from speedrun.data.prepare import prepare
    from speedrun.data.sources import iter_documents

    root = tmp_path_factory.mktemp("text")
    docs = [d for _, d in zip(range(600), iter_documents("wiki-vital"), strict=False)]
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return prepare(f"text:{src}", "bpe:512", root / "shards", log=lambda *_: None)


@pytest.fixture
def data_copy(text_data, tmp_path) -> Path:
    """A copy of the test dataset that a test may damage."""
    copy = tmp_path / "data"
    shutil.copytree(text_data, copy)
    return copy


@pytest.fixture(scope="session")
def library_results(text_data, tmp_path_factory) -> dict:
    """What the in-library checks found on 2 gloo processes (tests/library_checks.py, run in
    tests/two_processes.py's one launch); tests using it carry `two_processes.SHARED`."""
    from tests import two_processes

    return two_processes.library_results(text_data, tmp_path_factory)


def inductor_cpu_codegen():
    """A context for compiling with inductor on this CPU. Where torch runs its AVX2 kernels (an AVX2-only CPU,
    or ATEN_CPU_CAPABILITY=avx2), torch 2.13's vectorized C++ miscompiles two of the suite's graphs: #85's
    MUDD gate network (an index out of bounds) and #344's FP8 Q/K/V (inf). There they compile to scalar C++
    (cpp.simdlen = 1). The tests check the graph (no break, no recompile, eager's numbers), not CPU SIMD."""
    import torch

    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        return torch._inductor.config.patch({"cpp.simdlen": 1})
    return contextlib.nullcontext()


def speedrun_command(*args: str, nproc: int = 0) -> list[str]:
    """`python -m speedrun ARGS`, under torchrun with `nproc` processes when nproc > 0."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*(launcher if nproc else [sys.executable]), "-m", "speedrun", *args]


def run_speedrun(
    *args: str, nproc: int = 0, cwd: Path | None = None, subprocess_: bool = False
) -> subprocess.CompletedProcess:
    """Run the CLI as a user would and capture its output and exit code.

    With `nproc` (torchrun) or `subprocess_=True` it runs in a child process. Otherwise it calls
    `speedrun.cli.main` in this process, which is what `python -m speedrun` runs, without paying for a
    Python start and a torch import (seconds each on 2 cores); an unexpected exception still fails the
    test, as a traceback would."""
    if nproc or subprocess_:
        return subprocess.run(
            speedrun_command(*args, nproc=nproc), capture_output=True, text=True, cwd=cwd, timeout=300
        )
    from speedrun.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd or here)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's --help / --version
                code = e.code if isinstance(e.code, int) else 0
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["speedrun", *args], code, out.getvalue(), err.getvalue())


def another_run(run: Path, dest: Path) -> Path:
    """A copy of `run` standing for another run with the same results: it gets a run id of its own (a
    plain copy is the same run, which `compare` counts once)."""
    import uuid

    shutil.copytree(run, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "run_id": uuid.uuid4().hex}))
    return dest


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_for_metrics(run_dir: Path, lines: int, timeout_s: float = 120) -> None:
    """Block until a running job's metrics.jsonl has `lines` records (the job is inside its loop)."""
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + timeout_s
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= lines):
        time.sleep(0.05)


#: xdist groups whose tests share a child-process launch (tests/two_processes.py's torchrun of 2 gloo
#: processes; tests/perf_interpreted.py's Triton interpreter): slow, whatever the folder they live in
CHILD_LAUNCHES = ("two_processes", "perf_interpreted")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests of a shared child-process launch are slow. Slow (end-to-end, multi-process) tests first: the
    two pytest-xdist workers then finish together on the many short ones instead of one waiting for a late
    long test."""
    for item in items:
        group = item.get_closest_marker("xdist_group")
        if group is not None and group.args and group.args[0] in CHILD_LAUNCHES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
