"""`prepare`'s tokenizer workers: no more processes than cores, gone with the parent."""

from __future__ import annotations

import os
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
        import multiprocessing
        import threading

        class Slow:  # a tokenizer that takes a minute per document
            def encode_ordinary(self, text):
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
            time.sleep(3)  # the workers have started and taken a batch each
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
