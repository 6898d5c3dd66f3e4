"""The demo-tuning table of docs/benchmarks.md: for each run folder, the steps, training time and final
val bpb, and the training time it took to reach the first folder's (the baseline's) final bpb, linear
between validations, with its ratio to the baseline's own time (< 1: sooner).

    python benchmarks/demo_tuning/table.py BASELINE_RUN OTHER_RUN ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_peers import time_to  # noqa: E402  (one interpolation rule for both benchmarks)


def curve(run: Path) -> list[dict]:
    """(seconds, bpb) of every validation after step 0: `time_s` is the run's training clock."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [
        {"seconds": r["time_s"], "bpb": r["val_bpb"], "step": r["step"]}
        for r in rows
        if "val_bpb" in r and r["step"] > 0
    ]


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: table.py BASELINE_RUN OTHER_RUN ...", file=sys.stderr)
        return 2
    runs = [Path(a) for a in argv]
    curves = {r: curve(r) for r in runs}
    target = curves[runs[0]][-1]["bpb"]
    base_time = curves[runs[0]][-1]["seconds"]
    print(f"target: the baseline's final {target:.4f} bpb at {base_time:.1f} s of training")
    print("| run | recipe | steps | train time | val bpb | time to the baseline's bpb | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        c, cfg = curves[r], json.loads((r / "config.json").read_text())
        t = time_to(c, target)
        ratio = f"{t / base_time:.2f}" if t is not None else "-"
        shown = f"{t:.1f} s" if t is not None else "never"
        last = c[-1]
        print(
            f"| {r.name} | {cfg['recipe']} | {last['step']} | {last['seconds']:.1f} s | {last['bpb']:.4f} "
            f"| {shown} | {ratio} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
