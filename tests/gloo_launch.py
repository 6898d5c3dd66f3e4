"""The suite's one torchrun launch of in-library 2-process checks: every recipe's losses
(tests/recipe_matrix.py), compiled DDP (tests/ddp_compile.py) and distributed Muon
(tests/test_muon_distributed.py). A launch costs three torch imports
(the launcher and two ranks, ~9 s of CPU on 2 cores), so it is paid once; the `gloo_launch` fixture in
tests/conftest.py runs it for the tests that read its results.

`python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.gloo_launch FOLDER`
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from speedrun.train.distributed import teardown
from tests import ddp_compile, recipe_matrix, test_muon_distributed


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(sys.argv[1])
    results = {
        "recipes": recipe_matrix.every_recipe(rank, world),
        "ddp_compile": ddp_compile.eager_and_compiled(rank, world),
    }
    test_muon_distributed.on_two_ranks(rank, folder)
    if rank == 0:
        (folder / "results.json").write_text(json.dumps(results))
    teardown(clean=True)  # a rank that leaves while its peer's last collective drains aborts the peer


if __name__ == "__main__":
    main()
