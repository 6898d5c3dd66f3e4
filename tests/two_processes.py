"""One torchrun launch of 2 gloo processes for every test that trains under torchrun with `speedrun train`.

Each process pays ~6 s of CPU to import torch (and torch._dynamo, which torch.optim imports) before it
trains for about a second; a launch is three processes. So the tests register their runs here (`job`,
at import) and the first one to ask for a run (`run_dir`, or `library_results` for the in-library checks
of tests/library_checks.py that run after the jobs) launches them all once per pytest worker:
every rank runs `speedrun.cli.main(["train", ...])` for each job in turn, what `torchrun -m speedrun
train ...` runs, the jobs sharing the process group the first one sets up (see `main`). Tests that use
it carry `SHARED` so that pytest-xdist gives them one worker.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.two_processes SPEC.json
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

SHARED = pytest.mark.xdist_group("two_processes")
LIBRARY = "library-checks"  # the status files of tests/library_checks.py, run after the jobs

#: name -> (arguments of `speedrun train` after `--out DIR`, built from the test dataset's folder;
#: whether to count host syncs during it, tests/count_host_syncs.py)
JOBS: dict[str, tuple[Callable[[Path], list[str]], bool]] = {}


def job(name: str, args: Callable[[Path], list[str]], count_syncs: bool = False) -> None:
    """Register a two-process run of `speedrun train --out DIR *args(text_data)`."""
    assert name not in JOBS or JOBS[name][1] == count_syncs, name
    JOBS[name] = (args, count_syncs)


@functools.cache
def _launch(text_data: Path, root: Path) -> Path:
    # counting jobs first: one-time costs (first calls, caches) land where a fresh process has them
    names = sorted(JOBS, key=lambda n: (not JOBS[n][1], n))
    spec = [{"name": n, "args": JOBS[n][0](text_data), "count_syncs": JOBS[n][1]} for n in names]
    (root / "spec.json").write_text(json.dumps(spec))
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen(
        [*launch, "-m", "tests.two_processes", str(root / "spec.json")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        log = proc.communicate(timeout=900)[0]
    except subprocess.TimeoutExpired:  # no rank left behind; the tests fail with the log, no relaunch
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0] + "\ntimed out after 900 s"
    (root / "launch.log").write_text(f"exit code {proc.returncode}\n{log}")
    return root


def run_dir(name: str, text_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of job `name`, trained on 2 processes (all jobs launched on first use);
    fails the test with that run's errors unless both ranks finished it with exit code 0."""
    assert name in JOBS, name
    return _finished(name, text_data, tmp_path_factory) / name


def library_results(text_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What tests/library_checks.py found on the 2 processes after the jobs: {"recipes": ...,
    "ddp_compile": ..., "folder": where the Muon check saved its tensors}."""
    root = _finished(LIBRARY, text_data, tmp_path_factory)
    return {**json.loads((root / "results.json").read_text()), "folder": str(root)}


def _finished(name: str, text_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The launch's folder once `name` (a job, or the library checks) ended with code 0 on both ranks."""
    root = tmp_path_factory.getbasetemp() / "two_processes"
    root.mkdir(exist_ok=True)
    root = _launch(text_data, root)
    status = [json.loads(p.read_text()) for p in sorted(root.glob(f"{name}.rank*.json"))]
    ok = len(status) == 2 and all(s["code"] == 0 for s in status)
    assert ok, [s["stderr"][-2000:] for s in status] or (root / "launch.log").read_text()[-3000:]
    return root


def _run(spec: dict, root: Path, rank: str) -> dict:
    """One job on this rank: `main(["train", ...])`, its exit code and stderr (a traceback included)."""
    from speedrun.cli import main

    out = root / spec["name"]
    args = ["train", "--out", str(out), *spec["args"]]

    def train() -> int:
        if not spec["count_syncs"]:
            return main(args)
        from tests.count_host_syncs import counting_host_syncs

        with counting_host_syncs(Path(f"{out}.syncs.rank{rank}.json")):
            return main(args)

    return _status(train)


def _status(call: Callable[[], int | None]) -> dict:
    """Exit code and stderr of `call` (None and its traceback when it raised)."""
    err, code = io.StringIO(), None
    with contextlib.redirect_stderr(err):
        try:
            code = call()
        except BaseException:  # an unexpected error: its traceback goes to the test, not lost in the log
            traceback.print_exc()
    return {"code": code, "stderr": err.getvalue()}


def main() -> None:
    """Every job in turn on this rank, in one process group: torch cannot set up a second group on
    torchrun's store reliably (gloo connects to addresses of the first: "Connection refused"), so the
    loop's teardown leaves it in place (`destroy_process_group` is a no-op until the last job)."""
    import torch.distributed as dist

    spec_file = Path(sys.argv[1])
    rank = os.environ["RANK"]
    destroy, dist.destroy_process_group = dist.destroy_process_group, lambda *_a, **_k: None
    root = spec_file.parent
    try:
        for spec in json.loads(spec_file.read_text()):
            status = _run(spec, root, rank)
            (root / f"{spec['name']}.rank{rank}.json").write_text(json.dumps(status))
            if status["code"] != 0:  # the other rank may wait in a collective of this job: stop both
                break
        else:  # then the in-library checks, in the same process group
            from tests import library_checks

            status = _status(lambda: library_checks.run(root) or 0)
            (root / f"{LIBRARY}.rank{rank}.json").write_text(json.dumps(status))
    finally:
        dist.destroy_process_group = destroy
        if dist.is_initialized():
            destroy()


if __name__ == "__main__":
    main()
