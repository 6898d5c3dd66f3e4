"""Third round of faults, third part (docs/bad-inputs.md, third table): a run stopped before its first
checkpoint, non-UTF-8 bytes in paths and arguments, copied runs in `compare`."""

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import another_run, run_speedrun
from tests.test_bad_inputs_more import FAST


@pytest.fixture(scope="module")
def uncheckpointed(text_data, tmp_path_factory) -> Path:
    """A finished tiny run that saved no checkpoint (read-only: tests copy it to change it)."""
    out = tmp_path_factory.mktemp("round3c") / "run"
    proc = run_speedrun("train", "--out", str(out), f"data.dir={text_data}", *FAST, "train.val_every=1")
    assert proc.returncode == 0, proc.stderr
    return out


def _losses(run: Path) -> list[tuple]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in records]


# --------------------------------------------------------------- a run stopped before its first checkpoint


def test_resume_of_a_run_stopped_before_its_first_checkpoint_starts_over(uncheckpointed, tmp_path):
    """What a kill (or a double Ctrl-C) at step 2 leaves: records up to step 2, no summary, no checkpoint.
    `--resume` starts it again from step 0 and ends with the uninterrupted run's metrics, each step
    once (before: `no checkpoint in RUN to resume from`, and `--out RUN` refused the folder too)."""
    run = Path(shutil.copytree(uncheckpointed, tmp_path / "run"))
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    killed = [x for x in lines if json.loads(x)["step"] <= 2]
    (run / "metrics.jsonl").write_text("".join(killed) + '{"step": 3, "val_lo')  # and a torn line
    (run / "summary.json").unlink()
    run_id = json.loads((run / "config.json").read_text())["run_id"]
    proc = run_speedrun("train", "--resume", str(run))
    assert proc.returncode == 0, proc.stderr
    assert _losses(run) == _losses(uncheckpointed)
    assert json.loads((run / "config.json").read_text())["run_id"] == run_id  # the same run, started over
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run)).Reload()  # TensorBoard shows each step once, not both attempts
    assert [e.step for e in events.Scalars("train_loss")] == [1, 2, 3]
    log = (run / "log.txt").read_text()
    assert f"no checkpoint in {run}, so the run starts again from step 0 (the {len(killed)} metrics" in log
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"


def test_resume_of_a_finished_run_without_checkpoints_is_refused(uncheckpointed, tmp_path):
    run = Path(shutil.copytree(uncheckpointed, tmp_path / "run"))
    before = (run / "metrics.jsonl").read_bytes()
    proc = run_speedrun("train", "--resume", str(run))
    assert proc.returncode == 1 and proc.stderr.strip().endswith("already finished (3 of 3 steps)")
    assert (run / "metrics.jsonl").read_bytes() == before


# ----------------------------------------------------------------- bytes that are not UTF-8 in paths, args

XFF = "\udcff"  # what Python makes of a command-line byte 0xff (surrogateescape): `--out $'r\xff'`


def _main_on_a_terminal(*args: str, encoding: str = "utf-8") -> tuple[int, str, str]:
    """main() writing to standard output and error as a terminal of `encoding` takes them: strictly (in a
    UTF-8 locale such as en_US.UTF-8, Python's stdout refuses what is not UTF-8). (code, out, err)."""
    import contextlib
    import io

    from speedrun.cli import main

    out, err = (io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors="strict") for _ in range(2))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    out.flush(), err.flush()
    return code, out.buffer.getvalue().decode(encoding), err.buffer.getvalue().decode(encoding)


def test_prepare_with_a_source_and_folder_named_in_other_bytes(text_data, tmp_path):
    source = tmp_path / f"s{XFF}.jsonl"
    shutil.copy(text_data.parent / "docs.jsonl", source)
    data = tmp_path / f"d{XFF}"
    code, out, err = _main_on_a_terminal(
        "prepare", f"text:{source}", "--data-dir", str(data), "--max-tokens", "20000"
    )
    assert code == 0, err
    assert f"prepared text:{tmp_path}/s\\xff.jsonl in {tmp_path}/d\\xff" in out  # (before: a traceback)
    assert json.loads((data / "meta.json").read_bytes())["source"] == f"text:{source}"  # reads back exactly


def test_a_run_named_in_other_bytes_trains_resumes_evaluates_and_compares(text_data, tmp_path):
    data, run = Path(shutil.copytree(text_data, tmp_path / f"d{XFF}")), tmp_path / f"r{XFF}"
    args = ["--out", str(run), f"data.dir={data}", *FAST, "train.checkpoint_at_end=true"]
    code, out, err = _main_on_a_terminal("train", *args)
    assert code == 0, err
    for name in ("config.json", "summary.json", "checkpoints/step_000003/manifest.json"):
        json.loads((run / name).read_bytes())  # valid JSON (ASCII, with \udcff escapes) ...
    assert json.loads((run / "config.json").read_bytes())["data"]["dir"] == str(data)  # ... that reads back
    log = (run / "log.txt").read_bytes().decode("utf-8")  # valid UTF-8
    assert f"run dir {tmp_path}/r\\xff" in log and "TensorBoard: no event files" in log
    # the checkpoint is read (safetensors took only UTF-8 paths: it was called damaged)
    code, out, err = _main_on_a_terminal("train", "--resume", str(run))
    assert code == 1 and err.strip().endswith("already finished (3 of 3 steps)"), err
    assert _main_on_a_terminal("eval", str(run))[0] == 0
    assert _main_on_a_terminal("sample", str(run), "--max-tokens", "3", "--prompt", f"a{XFF}")[0] == 0
    other = shutil.copytree(run, tmp_path / f"r2{XFF}")
    code, out, err = _main_on_a_terminal(
        "compare", str(run), str(other), "--plot", str(tmp_path / f"p{XFF}.png")
    )
    assert code == 0, err
    assert "r\\xff " in out and (tmp_path / f"p{XFF}.png").stat().st_size > 0  # a legend matplotlib took


def test_read_weights_reads_what_safetensors_own_opener_reads(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from speedrun.train.run.checkpoint import read_weights

    tensors = {"w": torch.randn(3, 5), "b": torch.arange(4, dtype=torch.bfloat16)}
    save_file(tensors, tmp_path / "m.safetensors", metadata={"step": "12"})
    weights, metadata = read_weights(tmp_path / "m.safetensors")
    reference = load_file(tmp_path / "m.safetensors")
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        assert metadata == f.metadata()


def test_arguments_in_other_bytes_and_an_ascii_terminal():
    code, out, err = _main_on_a_terminal("train", "--dry-run", f"train.wandb_project={XFF}")
    assert code == 0 and '"wandb_project": "\\xff"' in out, err
    code, out, err = _main_on_a_terminal("train", "--dry-run", f"model.n_layer={XFF}")
    assert code == 2 and len(err.splitlines()) == 1 and "model.n_layer: expected an integer" in err
    code, out, err = _main_on_a_terminal("recipes", encoding="ascii")  # descriptions hold '·', '…'
    assert code == 0 and "demo" in out, err


# ------------------------------------------------------------------------------ copied runs in compare


def _group_line(stdout: str) -> str:
    (line,) = [x for x in stdout.splitlines() if x.startswith("group ")]
    return line


def test_compare_counts_a_copied_run_once_and_keeps_the_copy_furthest_along(uncheckpointed, tmp_path):
    """A run copied to another folder (another disk, a backup) is one run: counted once (before: n=2 and
    a t-test on one run's loss), and of the copies the furthest along is kept, with one line saying so."""
    run = uncheckpointed
    copy = Path(shutil.copytree(run, tmp_path / "copy"))
    (copy / "summary.json").unlink()  # copied while it trained
    proc = run_speedrun("compare", str(copy), str(run))
    assert proc.returncode == 0, proc.stderr
    run_id = json.loads((run / "config.json").read_text())["run_id"]
    note = f"{copy} and {run} are copies of one run (run id {run_id}): counted once, from the latter"
    assert proc.stdout.splitlines()[0] == note
    assert "n=1" in _group_line(proc.stdout) and "unfinished" not in proc.stdout  # the finished copy kept
    second = another_run(run, tmp_path / "second")  # a run of its own with the same losses still counts
    assert "n=2" in _group_line(run_speedrun("compare", str(run), str(second)).stdout)


def test_compare_of_runs_from_before_run_ids_keeps_the_real_path_rule(uncheckpointed, tmp_path):
    old = Path(shutil.copytree(uncheckpointed, tmp_path / "old"))
    config = json.loads((old / "config.json").read_text())
    del config["run_id"]
    (old / "config.json").write_text(json.dumps(config))
    (tmp_path / "link").symlink_to(old)
    proc = run_speedrun("compare", str(old), str(tmp_path / "link"))
    assert proc.returncode == 0 and "n=1" in _group_line(proc.stdout), proc.stderr


# ---------------------------------------------------------------------------------------- messages


@pytest.mark.parametrize("argv", [["train", "--bogus"], ["sample", "run", "--bogus"], ["recipes", "a", "b"]])
def test_an_unrecognized_argument_names_the_command_whose_help_lists_the_options(argv):
    proc = run_speedrun(*argv)  # (before: `speedrun: unrecognized ...`, pointing at the top-level --help)
    line = f"speedrun: error: speedrun {argv[0]}: unrecognized arguments: {argv[-1]} (see --help)"
    assert proc.returncode == 2 and proc.stderr == line + "\n"


def test_a_data_folder_that_is_a_file_is_named_a_file(tmp_path):
    file = tmp_path / "docs.jsonl"
    file.write_text("{}\n")
    proc = run_speedrun("train", "--out", str(tmp_path / "run"), f"data.dir={file}", *FAST)
    assert proc.returncode == 1
    # (before: "data folder not found; run `speedrun prepare SOURCE --data-dir FILE`", which refuses it)
    assert proc.stderr == f"speedrun: error: {file}: is a file, not a data folder made by speedrun prepare\n"


def test_seeds_repeat_the_steps_the_first_runs_time_budget_fixed(text_data, tmp_path, monkeypatch):
    """`--seeds` with a time budget: each run measured its own step time and fixed its own step count,
    so `compare` put the repeats in groups of one (no t-test). Later seeds now repeat the first run's
    resolved config. (Measured step times differ from run to run; here the budget rule says so.)"""
    import speedrun.train.plan.budget as budget

    counts = iter([6, 7, 8])
    monkeypatch.setattr(budget, "plan_steps", lambda *args: next(counts))
    budget = ["train.time_budget_s=60", "train.steps=20", "train.timing_warmup_steps=1", "train.log_every=1"]
    out = tmp_path / "rep"
    proc = run_speedrun("train", "--seeds", "1,2", "--out", str(out), f"data.dir={text_data}", *FAST, *budget)
    assert proc.returncode == 0, proc.stderr
    runs = [tmp_path / f"rep-seed{s}" for s in (1, 2)]
    assert [json.loads((r / "config.json").read_text())["train"]["steps"] for r in runs] == [6, 6]
    assert "n=2" in _group_line(run_speedrun("compare", *map(str, runs)).stdout)


def test_prepare_into_the_current_folder(text_data, tmp_path):
    """`--data-dir .` (an empty folder one stands in): the shards land there (before: the temporary
    folder was made inside it, and after all the work prepare refused to replace a folder holding it)."""
    here = tmp_path / "here"
    here.mkdir()
    source = f"text:{text_data.parent / 'docs.jsonl'}"
    proc = run_speedrun("prepare", source, "--data-dir", ".", "--max-tokens", "20000", cwd=here)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((here / "meta.json").read_text())["source"] == source


def test_resume_of_a_run_whose_config_json_is_a_fifo_is_refused_not_waited_on(uncheckpointed, tmp_path):
    """(Before: reading the named pipe waited forever for a writer; compare and eval check is_file.)"""
    import os
    import threading

    run = Path(shutil.copytree(uncheckpointed, tmp_path / "run"))
    (run / "config.json").unlink()
    os.mkfifo(run / "config.json")
    done: list = []
    thread = threading.Thread(
        target=lambda: done.append(run_speedrun("train", "--resume", str(run))), daemon=True
    )
    thread.start()
    thread.join(timeout=30)
    assert done, "--resume waited on the FIFO"
    line = (
        f"speedrun: error: {run / 'config.json'}: is a named pipe (FIFO), not a regular file; not reading it"
    )
    assert done[0].returncode == 1 and done[0].stderr == line + "\n"
