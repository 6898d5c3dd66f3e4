#!/usr/bin/env bash
# The same command's automatic choices, run after run (#35): precision (train.dtype=auto, Muon's
# iterations) and the demo's host fit, each from a fresh process, RUNS times at the current load and
# RUNS times beside BURNERS busy loops (load ~4 on a 2-core host). Prints one line per run; a stable
# host prints the same choices on every line. Also the bf16 probe's raw numbers (the probe decides only
# where the CPU flags and torch's checks are silent), to show how far a busy host moves them.
#   bash benchmarks/choice_stability.sh [RUNS=10] [BURNERS=4]
set -euo pipefail
RUNS=${1:-10}
BURNERS=${2:-4}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

choose() {
  python - <<'PY'
import torch
from speedrun import hardware
from speedrun.recipes import load_recipe
from speedrun.train.plan import host_fit
from speedrun.train.plan.precision import decide

cfg = load_recipe("demo", ["train.compile=off"])  # the demo's budget and size fit, eager (no compile time)
precision, rcfg, decided = decide(cfg, torch.device("cpu"), None)
lines = []
n, _ = host_fit.measure(rcfg, torch.device("cpu"), lines.append)
speedup, spread = hardware.bf16_speedup_probe()
fit = host_fit.shrunk(rcfg, n)
print(f"precision {decided['dtype']} (muon {decided['muon_ns_dtype']}) | host fit: {n} shrink(s) -> "
      f"{fit.train.global_batch_tokens} tokens/step, width {fit.model.n_embd} | probe: bf16 {speedup:.3f}x "
      f"fp32, spread {spread:.1f}x | {lines[-1] if lines else ''}")
PY
}

series() {
  echo "== $1: $(uptime | sed 's/.*load average: //') (1, 5, 15 min) =="
  for i in $(seq "$RUNS"); do printf '%2d ' "$i"; choose; done
}

series "as found"
pids=()
for _ in $(seq "$BURNERS"); do (while :; do :; done) & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
sleep 20  # let the load average rise
series "beside $BURNERS busy loops"
kill "${pids[@]}"
trap - EXIT
