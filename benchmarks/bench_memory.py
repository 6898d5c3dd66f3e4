"""The memory guard's estimate (train/plan/memory.py) against a fake-tensor measurement of the same step
(tests/fake_memory.py), every bundled recipe at full size: the training step's peak (the start of the
backward) and a validation forward's, eager; then the compiled estimate (the larger of the two) per
GPU of an 8-GPU run and, where a record's log gives one, the record's `torch.cuda.max_memory_allocated`.

Eager is compared on one process with one micro-batch (each of 8 GPUs' share of the records' step);
fake tensors own no memory, so a full-size step takes seconds on any CPU.

    PYTHONPATH=src python benchmarks/bench_memory.py [RECIPE ...]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ holds the measurement

from tests.fake_memory import fake_peak_bytes  # noqa: E402

from speedrun.recipes import load_recipe, recipe_names  # noqa: E402
from speedrun.train.plan.memory import estimate_memory  # noqa: E402

GiB = 2**30
#: `peak memory allocated` at the end of a record's log (records/track_1_short/<dir>/*.txt), 8xH100
RECORD_PEAKS = {
    "record-2025-01": 37653 * 2**20,  # 2025-01-16_Sub3Min
    "bos-align-2025-07": 33644 * 2**20,  # 2025-07-12_BosAlign/0c5449cc-…
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help="default: every bundled recipe")
    args = parser.parse_args()
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    print(
        f"{'recipe':26s} {'micro':>7s} | {'step est.':>9s} {'fake':>8s} {'ratio':>6s} | "
        f"{'val est.':>8s} {'fake':>8s} | {'compiled (1 of 8)':>17s} | record log"
    )
    for name in args.recipes or recipe_names():
        cfg = load_recipe(name, ["train.dtype=bf16"])  # the dtype CUDA resolves to
        micro = cfg.train.micro_batch_tokens
        one = load_recipe(name, ["train.dtype=bf16", f"train.global_batch_tokens={micro}"])
        eager = estimate_memory(one, 1, compiled=False)
        started = time.perf_counter()
        try:
            measured = fake_peak_bytes(one)
            fake = f"{measured['peak'] / GiB:8.2f}"
            ratio = f"{eager.backward_start / measured['peak']:6.3f}"
            fake_val = f"{measured['validation'] / GiB:8.2f}"
        except RuntimeError as e:  # a meta kernel stricter than the CPU one (bf16 params' Adam lerp)
            fake, ratio, fake_val = f"{'n/a':>8s}", f"{'':6s}", f"{'n/a':>8s}"
            print(f"  ({name}: fake step failed: {str(e)[:90]})", file=sys.stderr)
        compiled = estimate_memory(cfg, 8, compiled=True).total
        record = RECORD_PEAKS.get(name)
        print(
            f"{name:26s} {micro:7,d} | {eager.backward_start / GiB:9.2f} {fake} {ratio} | "
            f"{eager.validation / GiB:8.2f} {fake_val} | {compiled / GiB:17.2f} | "
            f"{f'{record / GiB:.2f}' if record else ''}"
            f"  ({time.perf_counter() - started:.1f}s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
