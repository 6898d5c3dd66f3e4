"""Third round of faults, second part (docs/bad-inputs.md, third table): compare's repeats, sample's
numbers, the compile flag in the log, overrides after options, permissions that are not damage."""

import json
import shutil
from pathlib import Path

from tests.conftest import run_speedrun
from tests.test_bad_inputs_round3 import finished  # noqa: F401  (the module's shared tiny run)

# ------------------------------------------------------------------------------------------ compare


def _group_line(stdout: str) -> str:
    (line,) = [x for x in stdout.splitlines() if x.startswith("group ")]
    return line


def test_compare_counts_a_run_once_however_it_is_named(finished, tmp_path, monkeypatch):  # noqa: F811
    link = tmp_path / "link"
    link.symlink_to(finished)
    monkeypatch.chdir(finished.parent)
    proc = run_speedrun("compare", str(finished), str(link), f"../{finished.parent.name}/run", "run")
    assert proc.returncode == 0, proc.stderr
    line = _group_line(proc.stdout)
    assert "n=1" in line and "p=" not in line, line  # one run is no evidence (before: n=4, p=0)
    copy = Path(shutil.copytree(finished, tmp_path / "copy"))  # a real second run still counts
    assert "n=2" in _group_line(run_speedrun("compare", str(finished), str(copy)).stdout)


def test_compare_leaves_stopped_and_killed_runs_out_of_the_test(finished, tmp_path):  # noqa: F811
    runs = [Path(shutil.copytree(finished, tmp_path / f"r{i}")) for i in range(4)]
    summary = json.loads((runs[2] / "summary.json").read_text())
    (runs[2] / "summary.json").write_text(json.dumps({**summary, "status": "stopped"}))
    (runs[3] / "summary.json").unlink()  # killed (or still running): no summary
    proc = run_speedrun("compare", *map(str, runs), "--target", "99")
    assert proc.returncode == 0, proc.stderr
    line = _group_line(proc.stdout)
    assert "n=2" in line and "2 unfinished run(s) left out" in line, line
    assert "r2 (stopped)" in proc.stdout and "r3 (unfinished)" in proc.stdout
