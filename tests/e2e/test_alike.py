"""tools/alike.py, the one rule for "alike": a race holds its data folder (a `prepare` between arms is
refused,
a changed meta.json too), a race resumed under another thread count is refused, compare splits runs of
other data into another group, verify flags them; and the tools' faults of issue 35 (counts, one-seed
estimates, a killed arm, verify's cross-checks and labels, torch's warnings)."""

import json
import os
import shutil
import signal
import sys
import threading
import uuid
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from speedrun.cli import main
from speedrun.errors import DataError
from speedrun.tools import race as race_tool
from tests.e2e.test_race import SWITCH, argv


def in_process(cmd: list[str]) -> tuple[int, None]:
    """race.run_child of `python -m speedrun ARGS`, run in this process (faster; same files)."""
    assert cmd[1:3] == ["-m", "speedrun"]
    return main(cmd[3:]), None


def fingerprints(run: Path) -> list[str]:
    return [ln.rsplit("meta sha256 ", 1)[1][:12] for ln in (run / "log.txt").read_text().splitlines()
            if ln.startswith("data: ") and "meta sha256" in ln]  # fmt: skip


@pytest.fixture(scope="module")
def race(text_data, tmp_path_factory):
    """A one-pair race on a copy of the data, which a `prepare` tries to replace after the first arm."""
    from speedrun.data.prepare import prepare

    root = tmp_path_factory.mktemp("alike")
    data = root / "data"
    shutil.copytree(text_data, data)
    other = root / "other.jsonl"
    other.write_text(
        "".join(json.dumps({"text": f"another corpus, line {i} " * 30}) + "\n" for i in range(300))
    )
    tried: list[str] = []

    def call(cmd):
        code = in_process(cmd)[0]
        if not tried:
            try:
                prepare(f"text:{other}", "bpe:512", data, log=lambda *_: None)
                tried.append("prepared again")
            except DataError as e:
                tried.append(str(e))
        return code

    patch = pytest.MonkeyPatch()
    patch.setattr(race_tool, "run_child", lambda cmd: (call(cmd), None))
    try:
        code = main(argv(data, root / "r", "--pairs", "1", SWITCH))
    finally:
        patch.undo()
    return SimpleNamespace(code=code, out=root / "r", data=data, tried=tried, root=root)


@pytest.mark.slow
def test_a_race_holds_its_data_folder(race):
    assert race.code == 0
    assert "a training run is reading this data folder" in race.tried[0]  # before: "prepared again"
    legs = [race.out / "A-pair1", race.out / "B-pair1"]
    assert len({p for leg in legs for p in fingerprints(leg)}) == 1


def test_the_data_hold_refuses_a_changed_meta_json(data_copy):
    """Where flock does nothing (some network mounts) the fingerprint still catches a folder prepared
    again: a meta.json with other counts between two runs."""
    from speedrun.recipes import load_recipe
    from speedrun.tools.alike import DataHold

    cfg = load_recipe("demo", [f"data.dir={data_copy}"])
    hold = DataHold()
    try:
        first = hold.check(cfg)
        assert first == hold.check(cfg)
        meta = json.loads((data_copy / "meta.json").read_text())
        meta["splits"]["train"]["tokens"] += 1
        (data_copy / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(DataError, match="prepared again during this comparison"):
            hold.check(cfg)
    finally:
        hold.close()


@pytest.mark.slow
def test_a_race_resumed_under_another_thread_count_is_refused(race, capsys, monkeypatch):
    moved = race.root / "threads"
    shutil.copytree(race.out, moved)
    (moved / "B-pair1" / "summary.json").unlink()  # stopped after its step-3 checkpoint: to resume
    shutil.rmtree(moved / "B-pair1" / "checkpoints" / "step_000006")
    monkeypatch.setattr(race_tool, "run_child", in_process)
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before > 1 else 2)
    try:
        code = main(argv(race.data, moved, "--pairs", "1", SWITCH))
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err.strip()
    assert code == 1 and "not alike (threads: " in err and "this host" in err and "\n" not in err, err
    assert not (moved / "B-pair1" / "summary.json").exists()


def copy_run(run: Path, to: Path, seed: int, data: str | None = None) -> Path:
    """A copy of `run` as another run (own id and seed), on other data when `data` names a source."""
    shutil.copytree(run, to)
    config = json.loads((to / "config.json").read_text())
    config["train"]["seed"] = seed
    config["run_id"] = uuid.uuid4().hex
    (to / "config.json").write_text(json.dumps(config))
    if data is not None:
        log = (to / "log.txt").read_text()
        (to / "log.txt").write_text(
            log.replace(f"meta sha256 {fingerprints(run)[0]}", "meta sha256 0123456789ab")
        )
        summary = json.loads((to / "summary.json").read_text()) | {"data_source": data}
        (to / "summary.json").write_text(json.dumps(summary))
    return to


@pytest.mark.slow
def test_compare_and_verify_keep_runs_of_other_data_apart(race, capsys):
    a = race.out / "A-pair1"
    same = copy_run(a, race.root / "same", 2)
    other = copy_run(a, race.root / "other", 3, data="text:elsewhere.jsonl")
    assert main(["compare", str(a), str(same), str(other), "--target", "9"]) == 0
    text = capsys.readouterr().out
    groups = [ln for ln in text.splitlines() if ln.startswith("group ")]
    assert len(groups) == 2 and "n=2" in groups[0] and "n=1" in groups[1], text  # before: one group, n=3
    assert "0123456789ab" in groups[1]
    assert main(["verify", str(a), str(same), str(other)]) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("alike"))
    assert "fails" in line and "0123456789ab" in line
    unrecorded = copy_run(a, race.root / "unrecorded", 4)  # an older run: its log has no fingerprint
    log = (unrecorded / "log.txt").read_text().splitlines()
    (unrecorded / "log.txt").write_text("\n".join(ln for ln in log if not ln.startswith("data: ")))
    assert main(["compare", str(a), str(unrecorded), "--target", "9"]) == 0
    groups = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("group ")]
    assert len(groups) == 1 and "n=2" in groups[0], groups  # what one run lacks sets no runs apart


@pytest.mark.slow
def test_verify_cross_checks_counts_and_names_each_runs_value(race, capsys):
    a, b = race.out / "A-pair1", race.out / "B-pair1"
    assert main(["verify", str(a), str(b)]) == 1
    config = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("config"))
    assert "B-pair1 differs from A-pair1: model.unet=true where A-pair1 has false" in config, config
    edited = shutil.copytree(a, race.root / "edited")
    summary = json.loads((edited / "summary.json").read_text())
    (edited / "summary.json").write_text(json.dumps(summary | {"timed_steps": 10 * summary["steps"]}))
    assert main(["verify", str(edited)]) == 1
    err = capsys.readouterr().err.strip()
    assert f"timed_steps {10 * summary['steps']} exceeds the run's {summary['steps']} steps" in err, err


def test_a_killed_arm_says_it_was_killed_and_where_its_log_is(text_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(race_tool, "run_child", lambda cmd: (-9, None))
    assert main(argv(text_data, tmp_path / "r", "--pairs", "1", SWITCH)) == 1
    err = capsys.readouterr().err.strip()
    assert "killed by SIGKILL" in err and "out of memory" in err and "\n" not in err, err
    assert (
        str(tmp_path / "r" / "A-pair1" / "log.txt") in err
        or str(tmp_path / "r" / "B-pair1" / "log.txt") in err
    )


@pytest.mark.parametrize(
    "args,flag",
    [
        (["race", "--pairs", "99999999999999999999", SWITCH], "--pairs"),
        (["race", "--pairs", "1001", SWITCH], "--pairs"),
        (["noise", "--repeats", "99999999999999"], "--repeats"),
        (["noise", "--seeds", "99999999999999"], "--seeds"),
        (["ablate", "--seeds", "1001", SWITCH], "--seeds"),
    ],
)
def test_counts_are_bounded_at_the_edge(args, flag, capsys):
    """Refused before the recipe is read (`no-such-recipe` would say so first), in one line."""
    assert main([args[0], "--recipe", "no-such-recipe", *args[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and ("1,000" in err or "..100" in err), err
    assert "\n" not in err and "no-such-recipe" not in err


def test_bench_counts_are_bounded(capsys):
    assert main(["bench", "--steps", "99999999999999", "--recipe", "no-such-recipe"]) == 2
    assert "--steps" in capsys.readouterr().err


def test_one_seed_gives_no_between_seed_sd(monkeypatch):
    """An sd needs two samples: one seed's between-seed sd is not measured, not 0."""
    from speedrun.tools import noise, results
    from speedrun.tools.ablate import Arm

    losses = {Path("r1"): 3.50, Path("r2"): 3.52}
    monkeypatch.setattr(
        results, "load_run", lambda p: results.Run(p, "demo", {}, final_val_loss=losses[p], status="finished")
    )
    cfg = SimpleNamespace(train=SimpleNamespace(seed=1))
    text = noise.report([Arm("noise", None, [(cfg, Path("r1")), (cfg, Path("r2"))])], None)
    assert "between-seed sd (what the seed adds): n/a (needs 2 seeds)" in text, text
    assert "fresh seed: sd n/a (needs 2 seeds)" in text and "0.0000" not in text.split("within")[1]


def test_the_sharded_collectives_raise_no_future_warning():
    """torch 2.12+ deprecates reduce_scatter_tensor / all_gather_into_tensor (8 warning lines per run)."""
    import torch.distributed as dist

    from speedrun.optim.sharded import Collectives

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            c = Collectives()
            inp, out = torch.arange(4.0), torch.zeros(4)
            c.reduce_scatter(out, inp).wait()
            c.all_gather(out, inp).wait()
        assert torch.equal(out, inp)
    finally:
        dist.destroy_process_group()


def test_eager_flex_on_cpu_is_quiet_and_exact():
    """The CPU forward runs flex_attention eagerly on purpose: torch's advice to compile is silenced,
    exactly that warning, and the result is dense attention's."""
    from torch.nn.attention.flex_attention import create_block_mask

    from speedrun.model.flex import flex_attend

    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 128, 128, device="cpu")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        y = flex_attend(q, k, v, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_a_stop_signal_reaches_the_arm_once_and_stops_the_race():
    """The run's process is in its own session: a SIGTERM to the race is forwarded to it once, and the
    race learns that it was stopped (it said nothing and exited 143 before, the arm stopping alone)."""
    child = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); time.sleep(60)"
    )
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        code, signum = race_tool.run_child([sys.executable, "-c", child])
    finally:
        timer.cancel()
    assert (code, signum) == (143, signal.SIGTERM)


def test_one_pair_gives_no_interval():
    """A race of one pair has a ratio but no interval or t-test: said as such, not as a bare '-'."""
    text = race_tool._ratio_text("train time", [60.0], [59.0])
    assert "95% CI n/a (needs 2 pairs)" in text and "paired t p n/a (needs 2 pairs)" in text, text
    assert "95% CI [" in race_tool._ratio_text("train time", [60.0, 61.0], [59.0, 61.5])


def test_the_data_fingerprint_is_the_content_not_the_path(text_data):
    """One corpus prepared under two paths is alike (a run copied from another machine); other token
    counts are not."""
    from speedrun.data.meta import meta_fingerprint

    meta = json.loads((text_data / "meta.json").read_text())
    moved = meta | {"source": "text:/elsewhere/docs.jsonl"}
    assert meta_fingerprint(moved) == meta_fingerprint(meta)
    other = json.loads(json.dumps(meta))
    other["splits"]["val"]["tokens"] -= 1
    assert meta_fingerprint(other) != meta_fingerprint(meta)
