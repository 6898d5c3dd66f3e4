"""The hot path never waits for the host: between log points the loop makes no host-device sync and no
control collective, so more steps between two log points cost no extra waits."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY

HERE = Path(__file__).parent


@pytest.mark.slow
def test_steps_between_log_points_make_no_host_syncs_or_collectives(text_data, tmp_path):
    args = [f"data.dir={text_data}", *TINY, "train.warmdown_steps=0", "train.val_every=0"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    counts = {}
    for steps in (4, 12):
        out = tmp_path / f"steps{steps}"
        proc = subprocess.run(
            [*launch, str(HERE / "count_host_syncs.py"), str(out), str(steps), *args],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        counts[steps] = [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)]
    for short, long_ in zip(counts[4], counts[12], strict=True):
        # Both runs have the same log points (first step, end of timing warm-up, last step) and one
        # validation; the long one has 8 more steps between them. Those steps must add nothing.
        assert long_ == short, counts
        # ... and the fixed cost is small: per log point one device wait to stop the clock and one
        # read of the (loss, stop) values riding on one all-reduce; validation reads its sums once.
        assert short.get("all_reduce", 0) <= 3 + 1, counts
        assert short.get("item", 0) + short.get("tolist", 0) <= 3 + 1, counts
