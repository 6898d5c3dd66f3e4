"""The suite's one torchrun launch of in-library 2-process checks: every recipe's losses
(tests/recipe_matrix.py) and compiled DDP (tests/ddp_compile.py). A launch costs three torch imports
(the launcher and two ranks, ~9 s of CPU on 2 cores), so it is paid once; the `gloo_launch` fixture in
tests/conftest.py runs it for the tests that read its results.

`python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.gloo_launch OUT`
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from speedrun.train.distributed import teardown
from tests import ddp_compile, recipe_matrix


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {
        "recipes": recipe_matrix.every_recipe(rank, world),
        "ddp_compile": ddp_compile.eager_and_compiled(rank, world),
    }
    if rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))
    teardown(clean=True)  # a rank that leaves while its peer's last collective drains aborts the peer


if __name__ == "__main__":
    main()
