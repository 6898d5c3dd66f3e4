"""What the bad-input tests (tests/e2e/test_bad_inputs_*.py, docs/bad-inputs.md) share: the tiny run's
overrides (FAST), the one-line checks of a failed command. (The finished runs they read, and the damaged
inputs several files make, are fixtures of tests/e2e/conftest.py.)"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

from speedrun.cli import main
from speedrun.config.stages import parse_stages
from tests.conftest import TINY, run_speedrun


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def _specials(tmp_path: Path) -> dict[str, Path]:
    """A symbolic link to a file of the user's, a FIFO and (where mknod is allowed) a device node."""
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's file\n")
    out = {"link": tmp_path / "link"}
    out["link"].symlink_to(precious)
    out["fifo"] = tmp_path / "fifo"
    os.mkfifo(out["fifo"])
    try:
        os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        out["device"] = tmp_path / "null"
    except OSError:
        pass
    return out


def _untouched(tmp_path: Path, specials: dict[str, Path]) -> None:
    assert (tmp_path / "precious.txt").read_text() == "the user's file\n"
    assert specials["link"].is_symlink() and stat.S_ISFIFO(specials["fifo"].lstat().st_mode)
    if "device" in specials:
        assert stat.S_ISCHR(specials["device"].lstat().st_mode)


def _edit_meta(folder: Path, edit) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta["splits"])
    (folder / "meta.json").write_text(json.dumps(meta))


def _group_line(stdout: str) -> str:
    (line,) = [x for x in stdout.splitlines() if x.startswith("group ")]
    return line


def _losses(run: Path) -> list[tuple]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in records]


XFF = "\udcff"  # what Python makes of a command-line byte 0xff (surrogateescape): `--out $'r\xff'`


def _main_on_a_terminal(*args: str, encoding: str = "utf-8") -> tuple[int, str, str]:
    """main() writing to standard output and error as a terminal of `encoding` takes them: strictly (in a
    UTF-8 locale such as en_US.UTF-8, Python's stdout refuses what is not UTF-8). (code, out, err)."""
    import contextlib
    import io

    out, err = (io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors="strict") for _ in range(2))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    out.flush(), err.flush()
    return code, out.buffer.getvalue().decode(encoding), err.buffer.getvalue().decode(encoding)


MOMENTUM = {"momentum_min": 0.85, "momentum_max": 0.95, "momentum_warmup": 4, "momentum_cooldown": 3}


EXT = "tokens=128 windows=1/1 ext=2"


def plan(text: str, steps: int = 14):
    return parse_stages(text, steps, cooldown_frac=0.5, lr_floor=0.15, **MOMENTUM)


REPORTS = [("verify", "RUN", "--json"), ("compare", "RUN", "--plot"), ("bench", "--recipe", "demo", "--json")]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("speedrun: error:") and "Traceback" not in err[0], err
    return err[0]


SHORT = ["train.steps=2", "train.warmdown_steps=1", "train.val_every=0"]


def error_line(proc, code: int, *words: str) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == code, (proc.returncode, err)
    assert err.startswith("speedrun: error:") and "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


FAST = [*TINY, "train.steps=3", "train.warmdown_steps=1", "train.val_every=0"]


def one_line(proc: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """The single stderr line of a failed command (rank-specific lines say `speedrun (rank N):`)."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speedrun") and "error:" in lines[0], proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


LAUNCH_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _train(data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_speedrun("train", "--out", str(out), f"data.dir={data}", *FAST, *extra)
