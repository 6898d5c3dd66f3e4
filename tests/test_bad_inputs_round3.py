"""Bad inputs and faults of the third adversarial round (docs/bad-inputs.md, third table): nothing we
do not own is lost or written through, nothing is silently wrong, and every mistake is one line."""

import json
import os
import shutil
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from speedrun import atomic
from speedrun.errors import SpeedrunError
from speedrun.train.run.checkpoint import list_checkpoints
from tests.conftest import run_speedrun, speedrun_command, wait_for_metrics
from tests.test_bad_inputs_more import FAST, one_line


@pytest.fixture(scope="module")
def finished(text_data, tmp_path_factory) -> Path:
    """A finished tiny run with a checkpoint at every step (read-only: tests copy it to change it)."""
    out = tmp_path_factory.mktemp("round3") / "run"
    proc = run_speedrun(
        "train", "--out", str(out), f"data.dir={text_data}", *FAST, "train.checkpoint_every=1"
    )
    assert proc.returncode == 0, proc.stderr
    return out


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


# ------------------------------------------------------------------------- the one rule for our files


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


def test_files_we_write_never_follow_or_replace_links_pipes_or_devices(tmp_path):
    specials = _specials(tmp_path)
    for kind, path in specials.items():
        with pytest.raises(SpeedrunError, match=f"{path}: is a"):
            atomic.write_atomic(path, b"ours")
        with pytest.raises(SpeedrunError, match=f"{path}: is a"):
            os.close(atomic.open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT))
        assert kind in ("link", "fifo", "device")
    _untouched(tmp_path, specials)
    atomic.write_atomic(tmp_path / "plain.txt", b"ours")  # a regular file or a new name is written as before
    os.close(atomic.open_regular(tmp_path / "plain.txt", os.O_WRONLY | os.O_APPEND))
    assert (tmp_path / "plain.txt").read_bytes() == b"ours"
    folder = tmp_path / "big-disk"
    folder.mkdir()
    (tmp_path / "to-folder").symlink_to(folder)
    assert atomic.user_folder(tmp_path / "to-folder") == folder.resolve()  # followed: the user's chosen place
    with pytest.raises(SpeedrunError, match="not a folder"):
        atomic.user_folder(specials["link"])


def test_compare_plot_and_bench_json_onto_a_link_or_fifo(finished, tmp_path):
    specials = _specials(tmp_path)
    for path in (specials["link"], specials["fifo"]):
        one_line(run_speedrun("compare", str(finished), "--plot", str(path)), 1, f"{path}: is a")
        one_line(
            run_speedrun("bench", "--json", str(path), "--steps", "1", "--warmup", "0", *FAST), 1, "is a"
        )
    _untouched(tmp_path, specials)


def test_resume_never_truncates_what_a_linked_lock_file_points_to(finished, tmp_path):
    run = copy_run(finished, tmp_path / "run")
    (run / ".speedrun.lock").unlink(missing_ok=True)
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's file\n")
    (run / ".speedrun.lock").symlink_to(precious)
    one_line(run_speedrun("train", "--resume", str(run)), 1, ".speedrun.lock: is a symbolic link")
    assert precious.read_text() == "the user's file\n"


def test_prepare_into_a_link_to_a_folder_fills_the_folder_and_keeps_the_link(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 30}) + "\n" for i in range(50)))
    disk = tmp_path / "big-disk" / "shards"
    disk.mkdir(parents=True)
    link = tmp_path / "data"
    link.symlink_to(disk)
    proc = run_speedrun("prepare", f"text:{src}", "--tokenizer", "bpe:300", "--data-dir", str(link))
    assert proc.returncode == 0, proc.stderr
    assert link.is_symlink() and link.resolve() == disk.resolve()
    assert (disk / "meta.json").is_file()
    run_speedrun("prepare", f"text:{src}", "--tokenizer", "bpe:300", "--data-dir", str(link))
    assert link.is_symlink() and (disk / "meta.json").is_file()  # prepared again: still the link


def test_prepare_into_a_mount_point_fails_before_any_work(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        src = tmp_path / "docs.jsonl"
        src.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(50)))
        proc = run_speedrun("prepare", f"text:{src}", "--tokenizer", "bpe:300", "--data-dir", str(mnt))
        one_line(proc, 1, "is a mount point", f"--data-dir {mnt / 'data'}")
        assert "prepare text:" not in proc.stdout  # refused before tokenizing anything
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


# ----------------------------------------------------------------------------------------- signals


def test_sighup_stops_cleanly_like_sigterm(text_data, tmp_path):
    """A closed terminal or a dropped ssh sends SIGHUP: the run saves a checkpoint and says how to go on."""
    out = tmp_path / "run"
    overrides = [*FAST, "train.steps=400", "train.log_every=1", "train.dtype=fp32"]
    args = speedrun_command("train", "--out", str(out), f"data.dir={text_data}", *overrides)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_metrics(out, 2, timeout_s=900)  # a loaded machine can take minutes to reach step 1
    assert (out / "metrics.jsonl").read_text().count("\n") >= 2, "the run never reached its loop"
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGHUP, stderr
    assert "stopped by SIGHUP" in stderr and f"--resume {out}" in stderr and "Traceback" not in stderr
    assert list_checkpoints(out)  # the steps so far are saved


# ------------------------------------------------------------------------------ prepared data folders


def _edit_meta(folder: Path, edit) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta["splits"])
    (folder / "meta.json").write_text(json.dumps(meta))


def test_a_meta_json_that_trains_on_the_val_shards_is_refused(finished, data_copy, tmp_path):
    val = json.loads((data_copy / "meta.json").read_text())["splits"]["val"]

    def train_on_val(splits):
        splits["train"]["shards"] += val["shards"]
        splits["train"]["tokens"] += val["tokens"]  # counts agree with the headers: only the overlap is wrong

    _edit_meta(data_copy, train_on_val)
    proc = run_speedrun("train", "--out", str(tmp_path / "run"), f"data.dir={data_copy}", *FAST)
    one_line(proc, 1, "meta.json", "listed under both train and val")
    one_line(run_speedrun("eval", str(finished), "--data", str(data_copy)), 1, "listed under both")


def test_meta_json_counts_must_agree_with_the_shard_headers(data_copy, tmp_path):
    def inflate(splits):
        splits["val"]["tokens"] *= 10

    _edit_meta(data_copy, inflate)
    proc = run_speedrun("train", "--out", str(tmp_path / "run"), f"data.dir={data_copy}", *FAST)
    one_line(proc, 1, "meta.json", "says the val split holds", "its shards' headers hold")


# ------------------------------------------------------------------------------- runs and checkpoints


def test_the_newest_checkpoint_is_chosen_by_step_number(finished, tmp_path):
    """Name sort put `step_6` after `step_000008` and `step_1000000` before `step_999999`; then
    checkpoint_keep deleted the newest."""
    from speedrun.train.run.checkpoint import list_checkpoints as listed

    root = tmp_path / "run" / "checkpoints"
    for name in ("step_999999", "step_6", "step_1000000", "step_000008"):
        (root / name).mkdir(parents=True)
    steps = [int(p.name.split("_")[1]) for p in listed(tmp_path / "run")]
    assert steps == sorted(steps) == [6, 8, 999999, 1000000]


@pytest.mark.parametrize("command", ["eval", "sample"])
def test_eval_and_sample_refuse_a_damaged_checkpoint(finished, tmp_path, command):
    run = copy_run(finished, tmp_path / "run")
    weights = run / "checkpoints" / "step_000003" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one changed byte in a weight: still loads, silently wrong
    weights.write_bytes(bytes(data))
    extra = ["--max-tokens", "2"] if command == "sample" else []
    one_line(run_speedrun(command, str(run), *extra), 1, "step_000003 is damaged", "sha256")


def test_eval_limit_without_hellaswag_is_refused(finished):
    one_line(run_speedrun("eval", str(finished), "--limit", "5"), 2, "--limit", "needs --hellaswag")


def test_resume_given_a_checkpoint_folder_names_the_run(finished, tmp_path):
    run = copy_run(finished, tmp_path / "run")
    ckpt = run / "checkpoints" / "step_000003"
    before = sorted(p.name for p in ckpt.iterdir())
    one_line(run_speedrun("train", "--resume", str(ckpt)), 2, "is a checkpoint of the run", f"--resume {run}")
    assert sorted(p.name for p in ckpt.iterdir()) == before  # no lock, log or metrics written into it


@pytest.mark.parametrize("where", ["checkpoints/step_000010", "checkpoints/step_000003/inner"])
def test_a_new_run_is_never_made_inside_a_checkpoint(finished, tmp_path, text_data, where):
    run = copy_run(finished, tmp_path / "run")
    out = run / where
    proc = run_speedrun("train", "--out", str(out), f"data.dir={text_data}", *FAST)
    one_line(proc, 2, "is inside the checkpoint")
    assert not out.exists()


@pytest.mark.parametrize("out", [".", "/"])
def test_seeds_with_an_out_that_has_no_name(out):
    one_line(run_speedrun("train", "--seeds", "1,2", "--out", out, "--dry-run", *FAST), 2, "name a folder")
