"""The hot path never waits for the host: between log points the loop makes no host-device sync and no
control collective, so more steps between two log points cost no extra waits."""

import json

import pytest

from tests import two_processes
from tests.conftest import TINY

STEPS = 12  # log points: the first step, the end of the timing warm-up (2 steps) and the last step
two_processes.job(
    "host_syncs",
    lambda data: [
        f"data.dir={data}",
        *TINY,
        "train.warmdown_steps=0",
        "train.val_every=0",
        f"train.steps={STEPS}",
        f"train.log_every={STEPS}",
    ],  # fmt: skip
    count_syncs=True,
)


@pytest.mark.slow
@two_processes.SHARED
def test_steps_between_log_points_make_no_host_syncs_or_collectives(text_data, tmp_path_factory):
    """Counted on both ranks of a torchrun launch (tests/count_host_syncs.py)."""
    out = two_processes.run_dir("host_syncs", text_data, tmp_path_factory)
    for rank in (0, 1):
        counts = json.loads(out.with_name(f"{out.name}.syncs.rank{rank}.json").read_text())
        at = counts["at_steps"]
        assert len(at) == STEPS, counts
        # Steps 3 to 11 (0-based 2..10 start a step that is no log point and no validation): from the
        # start of one to the start of the next, nothing may wait for the device or for other ranks.
        quiet = [(i, at[i], at[i + 1]) for i in range(2, STEPS - 1)]
        assert [i for i, before, after in quiet if before != after] == [], counts
        # ... and the fixed cost is small: per log point one device wait to stop the clock and one
        # read of the (loss, stop) values riding on one all-reduce; validation reads its sums once.
        total = counts["total"]
        assert total.get("all_reduce", 0) <= 3 + 1, counts
        assert total.get("item", 0) + total.get("tolist", 0) <= 3 + 1, counts
