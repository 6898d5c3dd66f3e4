"""`prepare`'s tokenizer workers: no more processes than cores, gone with the parent."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from speedrun.data import prepare

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics")


def test_workers_above_the_core_count_are_capped(monkeypatch):
    monkeypatch.setattr(prepare, "default_workers", lambda: 3)
    assert prepare.check_options(1000, None, 10) == 3
    assert prepare.check_options(2, None, 10) == 2
    assert prepare.check_options(None, None, 10) == 3


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(
        textwrap.dedent("""
        import os, signal, sys, time
        from speedrun.data import pipeline
        from speedrun.data.pipeline import Batch
        from speedrun.data.tokenizers import gpt2_tokenizer

        def batches(n, on_third=None):
            for i in range(n):
                if i == 2 and on_third:
                    on_third()
                b = Batch()
                b.texts, b.is_val, b.chars = ["hello world"] * 4, [False] * 4, 44
                yield b
        """)
        + textwrap.dedent(body)
    )
    return path


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_workers_die_with_their_parent(tmp_path):
    """An OOM kill (SIGKILL) of prepare leaves no tokenizer worker behind, busy ones included."""
    script = _script(
        tmp_path,
        """
        import glob
        import multiprocessing
        import threading

        BUSY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "busy-")

        class Slow:  # a tokenizer that takes a minute per document
            def encode_ordinary(self, text):
                open(f"{BUSY}{os.getpid()}", "w").close()  # this worker has taken a batch
                time.sleep(60)
                return []

        class SlowTok:
            eot_id, encoding = 0, Slow()

        if __name__ == "__main__":
            # encode_batches is a generator: run it on a thread so that this one can watch its workers
            run = lambda: next(pipeline.encode_batches(batches(100), SlowTok(), 2))
            threading.Thread(target=run, daemon=True).start()
            started = time.monotonic()
            while len(multiprocessing.active_children()) < 2 and time.monotonic() < started + 30:
                time.sleep(0.05)
            print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
            while len(glob.glob(BUSY + "*")) < 2 and time.monotonic() < started + 30:
                time.sleep(0.02)  # until the workers have started and taken a batch each
            os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    # before workers died with the parent, this waited for the orphans to close its stdout and timed out
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) >= 2, proc.stderr
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:  # do not leave them behind when the test fails
        os.kill(p, signal.SIGKILL)
    assert not left


def _spawned_workers(parent: int) -> int:
    """How many of `parent`'s children are multiprocessing workers past their exec (still starting)."""
    count = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                count += b"spawn_main" in (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
    return count


def _blocked_signals(pid: int) -> str:
    """The process's blocked-signal mask (/proc's SigBlk), for the failure message."""
    try:
        return next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigBlk"))
    except (OSError, StopIteration):
        return "unknown"


def _tokens_written(data_dir: Path) -> bool:
    """True once the hidden build folder holds a train shard with tokens in it (tokenizing is under way)."""
    shards = data_dir.parent.glob(f".{data_dir.name}.tmp-*/.*_train_000000.bin.*")
    return any(p.stat().st_size > 4096 for p in shards if p.exists())


def _as_a_terminal_job() -> None:
    """In the child before exec: no signal blocked and Ctrl-C at its default, as a shell's foreground job
    starts. Signal masks and ignored signals are inherited across exec, so the test must not depend on
    the pytest worker's: twice in a fresh clone's full suite (never alone) prepare never saw the Ctrl-C
    and finished with exit 0; with this, it passes there."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("moment", "sig", "group"),
    [
        ("workers starting", signal.SIGINT, True),  # Ctrl-C: the terminal signals the process group
        ("tokenizing", signal.SIGHUP, True),  # a closed terminal, likewise
        ("tokenizing", signal.SIGTERM, True),  # `kill -- -PGID`, systemd stopping a unit
    ],
)
def test_a_stop_signal_during_prepare_is_one_line_and_leaves_nothing(tmp_path, moment, sig, group):
    """Ctrl-C while the workers start, a closed terminal or a `kill` while they tokenize: no worker or
    resource-tracker traceback, no hang, one line, exit 128 + N, no folder under the final name and no
    temporary folder left (hidden, and gigabytes for a big corpus); a re-run works. (Before: a worker
    still importing printed a KeyboardInterrupt traceback; SIGTERM and SIGHUP killed prepare and left
    its temporary folder; SIGHUP killed the resource tracker, restarted with tracebacks.)"""
    words = [f"w{i}" for i in range(500)]
    line = json.dumps({"text": " ".join(words)})
    (tmp_path / "src.jsonl").write_text((line + "\n") * 2500)  # 5 MB: a second of tokenizing
    data_dir = tmp_path / "shards"
    argv = ["prepare", f"text:{tmp_path / 'src.jsonl'}", "--data-dir", str(data_dir), "--workers", "2"]
    code = (  # two workers on a one-core host too, where --workers 2 would be capped to one
        "import sys; from speedrun.data import prepare; prepare.default_workers = lambda: 2; "
        f"from speedrun.cli import main; sys.exit(main({argv!r}))"
    )
    for _ in range(3):  # a loaded host can finish the whole prepare before the moment is seen: again
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # its own process group, as a terminal's foreground job has
            preexec_fn=_as_a_terminal_job,
        )  # fmt: skip
        ready = (lambda p=proc: _spawned_workers(p.pid) >= 2) if moment == "workers starting" else None
        ready = ready or (lambda: _tokens_written(data_dir))
        deadline = time.monotonic() + 60
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if moment == "workers starting":  # past the interpreter's start, into its imports
            time.sleep(0.05)
        if proc.poll() is None:
            break
        proc.communicate()
        shutil.rmtree(data_dir, ignore_errors=True)  # it finished: the moment was missed, not a failure
    else:
        pytest.fail(f"prepare finished three times before the moment '{moment}' could be caught")
    blocked = _blocked_signals(proc.pid)
    (os.killpg if group else os.kill)(proc.pid, sig)
    try:
        out, err = proc.communicate(timeout=60)
    finally:  # a hang fails the test without leaving the processes behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, (out, err, f"blocked in prepare: {blocked}")
    by = "" if sig == signal.SIGINT else f" by {signal.Signals(sig).name}"
    assert err == f"speedrun: interrupted{by}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.jsonl"]  # no shards, no .shards.tmp-*
    if sig == signal.SIGTERM:
        from tests.conftest import run_speedrun

        # into the same folder; one worker tokenizes in this process (what is tested is the folder)
        again = run_speedrun(*argv, "--workers", "1", "--max-tokens", "100000")
        assert again.returncode == 0, again.stderr
        assert (data_dir / "meta.json").is_file()
