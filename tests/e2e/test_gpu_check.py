"""benchmarks/gpu_check.sh end to end on this machine: without CUDA the GPU parts say "skipped: no
CUDA" and the Muon op count runs; with --cpu-overrides the bench and snapshot parts run on the CPU on
shrunk recipes, and each finished stage's line, with the record's figure and our/record ratio, lands
in the summary; a deadline that has passed skips every part in one line each."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.recipe_matrix import shrink

ROOT = Path(__file__).resolve().parents[2]
GPU_PARTS = (
    "bench-record-2026-07",
    "bench-anvil-2026-08",
    "memory-snapshot",
    "bench-stages-2025-12-stage3",
)  # --full's
AB_PARTS = ("bench-record-2026-07", "graphs-manual", "graphs-trees", "compiled-updates")  # the default kit
# three scheduled stages of growing batch and windows, as the records' (the shrunk recipes have two)
THREE_STAGES = (
    "train.stages=tokens=256 windows=1/1 frac=1/3; tokens=512 windows=1/2 frac=1/3; "
    "tokens=512 windows=2/2 frac=1/3; tokens=512 windows=2/2 ext=0"
)

# fp32 and no FP8 everywhere: bf16 and FP8 are emulated ~100x slower on an AVX2 host; the kit's plumbing
# is what is tested here, the recipes' numerics elsewhere
FAST = ("model.block_dtype=fp32", "model.softcap_in_bf16=false", "model.ce_bf16=false",
        "model.fp8_head=false", "model.mlp_fp8=false")  # fmt: skip


def kit(*args: str, timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() or shutil.which("timeout") is None, reason="CPU check")
def test_gpu_check_runs_end_to_end_on_cpu_with_gpu_parts_skipped(tmp_path):
    out = tmp_path / "results"
    proc = kit("--out", str(out), "--deadline", "240")
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr
    assert "pytest-gpu: skipped: no CUDA" in summary
    for kernel in ("gram", "ba_plus_caa", "softcapped_ce", "relu2_linear"):  # bench_kernels.py
        assert f"kernel-{kernel}: skipped: no CUDA" in summary
    for name in AB_PARTS:
        assert f"{name}: skipped: no CUDA" in summary
    assert "memory-snapshot" not in summary  # --full only
    order = [summary.index(f"{name}: skipped") for name in (*AB_PARTS, "pytest-gpu", "kernel-gram")]
    assert order == sorted(order)  # the A/B of the step first, the kernel parts last
    assert "muon-ops: ok" in summary
    assert "code: this checkout, commit " in summary  # the package the parts measure
    assert "doctor: ok" in summary and "ok   torch: " in (out / "doctor.log").read_text()  # doctor first
    assert summary.index("doctor: ok") < summary.index("pytest-gpu: skipped")
    assert "aten ops per step()" in (out / "muon-ops.log").read_text()
    assert "cuda available False" in (out / "env.txt").read_text()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() or shutil.which("timeout") is None, reason="CPU check")
def test_gpu_check_parts_run_on_cpu_and_report_each_stage_against_its_anchor(tmp_path):
    """The kit's plumbing on tiny recipes (--full): record-2026-07's three stages (stage 3 first), the memory
    snapshot (its hook at the backward's start) and stages-2025-12's stage 3 run; every stage line names
    the record's figure and our/record ratio."""
    overrides = tmp_path / "overrides"
    overrides.mkdir()
    for recipe in ("record-2026-07", "stages-2025-12"):
        (overrides / f"{recipe}.txt").write_text("\n".join([*shrink(recipe), THREE_STAGES, *FAST]) + "\n")
    anvil = [*shrink("anvil-2026-08"), "model.ngram.rows=4096", "model.ngram.sign_rows=64", *FAST]
    anvil.append(THREE_STAGES.replace("frac=1/3;", "frac=1/3 sampled=384;", 2))  # #92 samples early
    (overrides / "anvil-2026-08.txt").write_text("\n".join(anvil) + "\n")
    out = tmp_path / "results"
    proc = kit("--out", str(out), "--deadline", "500", "--steps", "1", "--warmup", "1", "--full",
               "--cpu-overrides", str(overrides))  # fmt: skip
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr
    lines = [line for line in summary.splitlines() if line.startswith("bench-stage ")]
    want = [("record-2026-07", 3), ("record-2026-07", 1), ("record-2026-07", 2), ("anvil-2026-08", 3)]
    want += [("stages-2025-12", 3)]
    assert [tuple(line.split()[1:4:2]) for line in lines] == [(r, str(s) + ":") for r, s in want], summary
    anchored = [line for line in lines if "anvil" not in line]  # #92 has no one-GPU anchor (its table)
    assert all("ours/record" in line and "not like for like" in line for line in anchored)
    assert "record peak 39,736 MiB allocated" in lines[0]  # stage 3 first
    assert "memory_snapshot record-2026-07 stage 3: no CUDA: no snapshot (hooked: True)" in summary
    for name in GPU_PARTS:
        assert f"{name}: ok" in summary
    assert (out / "bench-record-2026-07.json").exists() and (out / "snapshot" / "snapshot.json").exists()


def test_gpu_check_refuses_a_bad_argument_in_one_line(tmp_path):
    bad_args = (["--deadline", "soon"], ["--steps", "0"], ["--cpu-overrides", str(tmp_path / "none")],
                ["--parts", "kernels,fast"])  # fmt: skip
    for bad in bad_args:
        proc = kit(*bad, "--out", str(tmp_path), timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and bad[0] in proc.stderr, proc.stderr


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_gpu_check_past_its_deadline_skips_each_part_in_one_line(tmp_path):
    out = tmp_path / "results"
    proc = kit("--out", str(out), "--deadline", "0", timeout=120)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 1
    assert "muon-ops: skipped: deadline reached" in summary and "done in" in summary
    assert "doctor: skipped: deadline reached" in summary


def test_graph_ratio_prints_plain_over_graphs_per_stage_timed_in_both(tmp_path):
    import json
    import sys

    plain = {
        "recipe": "record-2026-07",
        "stages": [{"stage": 3, "step_ms": 600.0}, {"stage": 1, "step_ms": 90.0}],
    }
    line = "CUDA graphs: manual step (4 keys x 2 untimed visits in the warm-up; perf/graphs.py)"
    graphs = {"recipe": "record-2026-07", "cuda_graphs": line, "stages": [{"stage": 3, "step_ms": 480.0}]}
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    (tmp_path / "graphs.json").write_text(json.dumps(graphs))
    script = str(ROOT / "benchmarks" / "graph_ratio.py")
    run = [sys.executable, script, str(tmp_path / "plain.json"), str(tmp_path / "graphs.json"), "manual"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.splitlines() == [
        "graphs manual record-2026-07 stage 3: 480.0 ms/step with graphs, 600.0 ms/step plain, "
        f"plain/graphs {600 / 480:.3f}"
    ]
    proc = subprocess.run([*run[:3], str(tmp_path / "none.json"), "trees"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("graphs trees: no ratio (FileNotFoundError")
    proc = subprocess.run([*run[:4], "trees"], capture_output=True, text=True)  # a manual run is no trees arm
    assert proc.stdout.startswith("graphs trees: no ratio (the bench ran without them: CUDA graphs: manual")


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_gpu_check_runs_only_the_parts_named(tmp_path):
    out = tmp_path / "results"
    proc = kit("--out", str(out), "--parts", "kernels", timeout=120)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr
    for name in (
        "doctor",
        "bench-record-2026-07",
        "graphs-manual",
        "graphs-trees",
        "compiled-updates",
        "muon-ops",
    ):
        assert f"{name}: skipped (--parts)" in summary
    assert "kernel-gram: skipped: no CUDA" in summary and "muon-ops: ok" not in summary


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_gpu_check_names_another_installed_package_as_what_it_measures(tmp_path):
    """A speedrun imported from elsewhere than this checkout (an installed wheel): the summary says so
    instead of giving the kit checkout's commit as the measured code's."""
    elsewhere = tmp_path / "site" / "speedrun"
    elsewhere.mkdir(parents=True)
    (elsewhere / "__init__.py").write_text("")
    out = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = kit("--out", str(out), "--parts", "kernels", timeout=120, env=env)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr
    assert f"code: the speedrun installed at {os.path.realpath(elsewhere)}, not this checkout" in summary
    assert "code: this checkout" not in summary
