"""Count the calls that make the host wait for the device or for other ranks during one `speedrun train`:
Tensor.item/tolist, CUDA synchronize, the loop's device wait and the control collectives (all_reduce,
broadcast, barrier). `counting_host_syncs(PATH)` writes the totals and the running counts at the start of
every training step to PATH, so the test can see which steps paid what. Used by tests/two_processes.py
on each rank of a torchrun launch (tests/unit/test_host_syncs.py).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

import speedrun.train.loop as loop
import speedrun.train.timing as timing


@contextlib.contextmanager
def counting_host_syncs(path: Path) -> Iterator[None]:
    """Count while the block runs (the patched functions are restored after it); write PATH at the end."""
    counts: Counter = Counter()
    at_steps: list[dict[str, int]] = []  # counts so far, at the start of each train_step call
    originals = []

    def counting(owner, name: str) -> None:
        """Count calls made from speedrun's own code (torch internals are not the loop's: on CPU, for
        instance, unfused Adam reads its step counter with .item(); fused Adam on CUDA does not)."""
        original = getattr(owner, name)
        originals.append((owner, name, original))

        def wrapper(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("speedrun"):
                counts[name] += 1
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    for name in ("item", "tolist"):
        counting(torch.Tensor, name)
    counting(torch.cuda, "synchronize")
    counting(timing, "wait_for_device")  # the loop's one device wait
    for name in ("all_reduce", "broadcast", "barrier"):
        counting(dist, name)
    step_function = loop.train_step

    def marked_step(*args, **kwargs):
        at_steps.append(dict(counts))
        return step_function(*args, **kwargs)

    originals.append((loop, "train_step", step_function))
    loop.train_step = marked_step
    try:
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)
    path.write_text(json.dumps({"total": dict(counts), "at_steps": at_steps}))
