"""benchmarks/gpu_check.sh end to end on this machine: without CUDA the GPU parts say "skipped: no
CUDA", the Muon op count runs, and everything lands in the one results folder."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("record-2025-01", "stages-2025-12", "banks-2026-01", "flex-2024-11")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() or shutil.which("timeout") is None, reason="CPU check")
def test_gpu_check_runs_end_to_end_on_cpu_with_gpu_parts_skipped(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--out", str(out), "--deadline", "240"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr
    assert "pytest-gpu: skipped: no CUDA" in summary
    for recipe in RECIPES:
        assert f"bench-{recipe}: skipped: no CUDA" in summary
    assert "muon-ops: ok" in summary
    assert "aten ops per step()" in (out / "muon-ops.log").read_text()
    assert "cuda available False" in (out / "env.txt").read_text()


def test_gpu_check_refuses_a_bad_argument_in_one_line(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--deadline", "soon", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--deadline" in proc.stderr
