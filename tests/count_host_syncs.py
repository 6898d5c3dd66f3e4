"""Run `speedrun train` (under torchrun) and count the calls that make the host wait
for the device or for other ranks: Tensor.item/tolist, CUDA synchronize, the loop's device wait and the
control collectives (all_reduce, broadcast, barrier). Writes, for each rank, OUT.rankR.json with the
totals and the running counts at the start of every training step, so the test can see which steps
paid what.

Usage: count_host_syncs.py OUT STEPS TRAIN_OVERRIDES...
"""

import json
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist

import speedrun.train.loop as loop
from speedrun.cli import main

counts: Counter = Counter()
at_steps: list[dict[str, int]] = []  # counts so far, at the start of each train_step call


def counting(owner, name: str) -> None:
    """Count calls made from speedrun's own code (torch internals are not the loop's: on CPU, for
    instance, unfused Adam reads its step counter with .item(); fused Adam on CUDA does not)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("speedrun"):
            counts[name] += 1
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


for name in ("item", "tolist"):
    counting(torch.Tensor, name)
counting(torch.cuda, "synchronize")
try:  # the loop's one device wait (absent before the loop stopped syncing every step)
    import speedrun.train.timing as timing

    counting(timing, "wait_for_device")
except ImportError:
    pass
for name in ("all_reduce", "broadcast", "barrier"):
    counting(dist, name)

step_function = loop.train_step


def marked_step(*args, **kwargs):
    at_steps.append(dict(counts))
    return step_function(*args, **kwargs)


loop.train_step = marked_step

out, steps, *train_args = sys.argv[1:]
code = main(["train", "--out", out, *train_args, f"train.steps={steps}", f"train.log_every={steps}"])
assert code == 0, code
with open(f"{out}.rank{os.environ.get('RANK', '0')}.json", "w") as f:
    json.dump({"total": dict(counts), "at_steps": at_steps}, f)
