"""The run directory: new-or-empty, locked while in use, metric lines never torn, summary.json."""

import errno
import json
import os
import stat

import pytest

from speedrun.errors import ConfigError, DataError, SpeedrunError
from speedrun.train.run import rundir
from speedrun.train.run.rundir import RunDir, read_records, write_summary


def test_lock_refuses_a_second_writer_and_is_released_on_close(tmp_path):
    from speedrun.config import Config

    first = RunDir(tmp_path / "run", echo=False)
    first.write_config(Config())
    with pytest.raises(SpeedrunError, match=f"in use by another speedrun process \\(pid {os.getpid()}\\)"):
        RunDir(tmp_path / "run", echo=False, resume=True)
    first.close()
    RunDir(tmp_path / "run", echo=False, resume=True).close()  # free again


def test_new_run_needs_a_new_or_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    RunDir(tmp_path / "empty", echo=False).close()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.csv").write_text("1,2")
    with pytest.raises(ConfigError, match="is not empty \\(holds data.csv\\)"):
        RunDir(tmp_path / "other", echo=False)
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["data.csv"]  # no lock file, no log


def test_default_run_dirs_never_collide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rundir.time, "strftime", lambda _fmt: "20260101-000000")
    first = rundir.default_run_dir("demo")
    first.mkdir(parents=True)
    assert rundir.default_run_dir("demo").name == "demo-20260101-000000-2"


def test_a_failed_metric_write_leaves_no_half_line(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run", echo=False)
    run.metric({"step": 1, "train_loss": 2.5})
    real_write = os.write

    def half_then_full(fd, data):  # the disk fills in the middle of the line
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "write", half_then_full)
    with pytest.raises(SpeedrunError, match="cannot write .*metrics.jsonl: No space left on device"):
        run.metric({"step": 2, "train_loss": 2.4})
    monkeypatch.undo()
    run.log("error: after the failure")  # the loop logs the error: must not mask the first one
    run.close()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1, "train_loss": 2.5}\n'


def test_a_short_write_is_cut_back(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run", echo=False)
    real_write = os.write
    monkeypatch.setattr(rundir.os, "write", lambda fd, data: real_write(fd, data[:5]))
    with pytest.raises(SpeedrunError, match="only 5 of"):
        run.metric({"step": 1, "train_loss": 2.5})
    monkeypatch.undo()
    run.close()
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == b""


@pytest.mark.parametrize("torn", [b'{"step": 3, "train_lo', b'{"step": 3, "train_lo\n', b'\xff\xfe{"st'])
def test_resume_repairs_a_torn_last_line(tmp_path, torn):
    run_dir = tmp_path / "run"
    run = RunDir(run_dir, echo=False)
    for step in (1, 2):
        run.metric({"step": step, "train_loss": 3.0 - step})
    run.close()
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(torn)
    (run_dir / "config.json").write_text("{}")
    resumed = RunDir(run_dir, echo=False, resume=True)
    resumed.truncate_metrics(2)
    resumed.metric({"step": 3, "train_loss": 0.5})
    resumed.close()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "metrics.jsonl: dropped a torn last line" in (run_dir / "log.txt").read_text()


def test_a_torn_final_validation_does_not_count(tmp_path):
    run = RunDir(tmp_path / "run", echo=False)
    run.metric({"step": 3, "train_loss": 1.0})
    assert not run.has_final_validation(3)
    with open(tmp_path / "run" / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 3, "val_loss": 1.2')  # killed while writing the final validation
    assert not run.has_final_validation(3)
    run.close()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 3, "val_loss": 1.2}\n')
    (tmp_path / "run" / "config.json").write_text("{}")
    resumed = RunDir(tmp_path / "run", echo=False, resume=True)
    assert resumed.has_final_validation(3) and not resumed.has_final_validation(4)
    resumed.close()


def test_a_damaged_middle_line_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(DataError, match="metrics.jsonl: line 2 is not a metrics record"):
        read_records(path)


def test_summary_is_atomic_valid_json_with_the_contract_keys(tmp_path):
    summary = dict.fromkeys(rundir.SUMMARY_KEYS, 1.0) | {"final_val_loss": float("nan"), "status": "stopped"}
    path = write_summary(tmp_path, summary)
    data = json.loads(path.read_text())
    assert list(data) == list(rundir.SUMMARY_KEYS)
    assert data["final_val_loss"] is None and data["status"] == "stopped"
    assert not list(tmp_path.glob(".*tmp"))
    with pytest.raises(ValueError, match="missing \\['status'\\]"):
        write_summary(tmp_path, {k: 1 for k in rundir.SUMMARY_KEYS if k != "status"})


def test_run_files_honour_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        run = RunDir(tmp_path / "run", echo=False)
        run.metric({"step": 1})
        run.log("hello")
        run.write_summary(dict.fromkeys(rundir.SUMMARY_KEYS))
        run.close()
    finally:
        os.umask(old)
    for name in ("metrics.jsonl", "log.txt", "summary.json"):
        assert stat.S_IMODE((tmp_path / "run" / name).stat().st_mode) == 0o640, name
