"""How a CPU run starts and whether it keeps its time budget: the first-run experience of `speedrun train`.

Runs the CLI as a user does, in a child process, and stamps every line it prints with the time since
the process started. Reports: the time to the first step line (the issue: it must come within 30 s for
a tiny eager run, with no silent stall), the precision and compile the run chose and why, the host fit,
the step count the budget fixed, and the timed training time against the budget (met within 10 % on a
quiet machine).

    python benchmarks/bench_cpu_start.py                          # the demo (prepares wiki-vital if needed)
    python benchmarks/bench_cpu_start.py --tiny                   # a tiny eager run: time to the first step
    python benchmarks/bench_cpu_start.py -- train.time_budget_s=60   # extra overrides for the demo

Emulate an AVX2-only CPU on an AVX-512 host with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (the run's
log says which precision that gave, and why).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = [
    "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "train.seq_len=64", "model.max_seq_len=64",
    "train.micro_batch_tokens=512", "train.global_batch_tokens=512", "train.steps=5",
    "train.warmdown_steps=2", "train.val_every=0", "train.val_tokens=4096", "train.compile=off",
    "train.time_budget_s=0", "train.budget_min_steps=0",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny eager demo-data run instead of the demo")
    parser.add_argument("overrides", nargs="*", help="key=value overrides passed to speedrun train")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-cpu-start-")) / "run"
    cmd = [sys.executable, "-u", "-m", "speedrun", "train", "--out", str(out)]
    cmd += (TINY if args.tiny else []) + args.overrides
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step = None
    for line in proc.stdout:
        now = time.perf_counter() - start
        if first_step is None and line.startswith("step ") and " loss " in line:
            first_step = now
        if line.startswith(("step ", "precision", "host fit", "compile:", "time budget", "done:", "error")):
            print(f"[{now:7.1f}s] {line.rstrip()}", flush=True)
    code = proc.wait()
    wall = time.perf_counter() - start
    print(
        f"exit {code}; wall {wall:.1f}s; first step line at {first_step if first_step else float('nan'):.1f}s"
    )
    summary_file = out / "summary.json"
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        cfg = json.loads((out / "config.json").read_text())
        budget = next(
            (float(o.split("=")[1]) for o in args.overrides if o.startswith("train.time_budget_s=")), None
        )
        budget = budget if budget is not None else (0.0 if args.tiny else 150.0)
        line = f"steps {summary['steps']} | train time {summary['train_time_s']:.1f}s"
        if budget:
            line += f" | budget {budget:g}s ({summary['train_time_s'] / budget - 1:+.1%})"
        print(line + f" | val loss {summary['final_val_loss']} | {summary['precision']['reason']}")
        m, t = cfg["model"], cfg["train"]
        print(f"sizes: {m['n_layer']}x{m['n_embd']}, {t['global_batch_tokens']} tokens/step")


if __name__ == "__main__":
    main()
