"""Compiled DDP overlaps the gradient all-reduce with the backward: dynamo's DDPOptimizer splits the
compiled graph at DDP's bucket boundaries, so each bucket's gradients are ready (and all-reduced)
while the backward of the earlier layers still runs.

The loop wraps the compiled module in DDP (`DDP(torch.compile(model, fullgraph=True))`): DDP's forward
marks itself active while it calls the module, and dynamo compiles a frame under an active DDP with
DDPOptimizer, which splits inside the backend (one dynamo graph, no graph break, so fullgraph holds).
The other order, `torch.compile(DDP(model), fullgraph=True)`, fails in torch 2.13: dynamo cannot trace
DDP's own `_pre_forward` (its logger), and without fullgraph that is a graph break in every step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ddp_compile import run

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_compiled_ddp_is_split_at_buckets_and_trains_like_eager_and_one_process(tmp_path):
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, "-m", "tests.ddp_compile", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(out.read_text())
    compiled, eager = two["compiled"], two["eager"]
    assert compiled["wrapper"] == "DistributedDataParallel"
    # one dynamo graph, no graph break (fullgraph), handed to the backend in more than one piece
    assert compiled["dynamo_graphs"] == 1 and compiled["graph_breaks"] == 0, compiled
    assert compiled["compiled_pieces"] > 1, compiled
    # fp32: DDP's (g1 + g2)/2 against one process's accumulated g1/2 + g2/2 agree to rounding
    one = run(False)["losses"]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5, abs=0)
    assert compiled["losses"] == pytest.approx(one, rel=1e-5, abs=0)
