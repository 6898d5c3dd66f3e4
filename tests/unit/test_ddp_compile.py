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

import pytest

from tests.ddp_compile import run
from tests.two_processes import SHARED


@pytest.mark.slow
@SHARED
def test_compiled_ddp_is_split_at_buckets_and_trains_like_eager_and_one_process(library_results):
    two = library_results["ddp_compile"]
    compiled, eager = two["compiled"], two["eager"]
    assert compiled["wrapper"] == "DistributedDataParallel"
    # one dynamo graph, no graph break (fullgraph), handed to the backend in more than one piece
    assert compiled["dynamo_graphs"] == 1 and compiled["graph_breaks"] == 0, compiled
    assert compiled["compiled_pieces"] > 1, compiled
    # fp32: DDP's (g1 + g2)/2 against one process's accumulated g1/2 + g2/2 agree to rounding
    one = run(False)["losses"]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5, abs=0)
    assert compiled["losses"] == pytest.approx(one, rel=1e-5, abs=0)
