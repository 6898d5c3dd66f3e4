"""The in-library 2-process checks, run by tests/two_processes.py's one torchrun launch after its
`speedrun train` jobs, in the same process group: every recipe's losses (tests/recipe_matrix.py),
compiled DDP (tests/ddp_compile.py), #71's sparse row exchange (tests/sparse_rows_check.py), #92's
ANVIL (fidelity/test_anvil.py), #92's row-sharded n-gram table (tests/ngram_rows_check.py), the reductions
from backward hooks (tests/overlap_check.py) and distributed Muon (tests/e2e/test_muon_distributed.py). Rank 0
writes `results.json` into the launch's folder; the tensors of the Muon check are saved beside it."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from tests import (
    ddp_compile,
    ngram_rows_check,
    overlap_check,
    recipe_matrix,
    sparse_rows_check,
)
from tests.e2e import test_muon_distributed
from tests.fidelity import test_anvil


def run(folder: Path) -> None:
    """Every check on this rank; the default process group is set up (by the jobs, or here)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {
        "recipes": recipe_matrix.every_recipe(rank, world),
        "ddp_compile": ddp_compile.eager_and_compiled(rank, world),
        "sparse_rows": sparse_rows_check.sparse_equals_dense(rank, world),  # #71
        "anvil": test_anvil.two_ranks(rank, world),  # #92
        "ngram_rows": ngram_rows_check.sharded_equals_single(rank, world),  # #92
        "overlap": overlap_check.hooked_equals_post_backward(rank, world),  # perf/overlap.py
    }
    test_muon_distributed.on_two_ranks(rank, folder)
    if rank == 0:
        (folder / "results.json").write_text(json.dumps(results))
