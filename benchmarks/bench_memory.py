"""The memory guard's estimate (train/memory.py) against a fake-tensor measurement of the same step
(tests/fake_memory.py), every bundled recipe at full size, plus the compiled estimate per GPU of an
8-GPU run and, where a record's log gives one, the record's own `torch.cuda.max_memory_allocated`.

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
from speedrun.train.memory import estimate_memory  # noqa: E402

GiB = 2**30
#: `peak memory allocated` at the end of a record's log (records/track_1_short/<dir>/*.txt), 8xH100
RECORD_PEAKS = {"record-2025-01": 37653 * 2**20}  # 2025-01-16_Sub3Min


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help="default: every bundled recipe")
    args = parser.parse_args()
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    print(
        f"{'recipe':26s} {'micro':>7s} | {'eager est.':>10s} {'fake':>8s} {'ratio':>6s} | "
        f"{'compiled est. (1 of 8)':>22s} | record log"
    )
    for name in args.recipes or recipe_names():
        cfg = load_recipe(name, ["train.dtype=bf16"])  # the dtype CUDA resolves to
        micro = cfg.train.micro_batch_tokens
        one = load_recipe(name, ["train.dtype=bf16", f"train.global_batch_tokens={micro}"])
        eager = estimate_memory(one, 1, compiled=False).total
        started = time.perf_counter()
        try:
            fake = f"{fake_peak_bytes(one)['peak'] / GiB:8.2f}"
            ratio = f"{eager / (float(fake) * GiB):6.3f}"
        except RuntimeError as e:  # a meta kernel stricter than the CPU one (bf16 params' Adam lerp)
            fake, ratio = f"{'n/a':>8s}", f"{'':6s}"
            print(f"  ({name}: fake step failed: {str(e)[:90]})", file=sys.stderr)
        compiled = estimate_memory(cfg, 8, compiled=True).total
        record = RECORD_PEAKS.get(name)
        print(
            f"{name:26s} {cfg.train.micro_batch_tokens:7,d} | {eager / GiB:10.2f} {fake} {ratio} | "
            f"{compiled / GiB:22.2f} | {f'{record / GiB:.2f}' if record else ''}"
            f"  ({time.perf_counter() - started:.1f}s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
