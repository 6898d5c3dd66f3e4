#!/usr/bin/env bash
# One of the side-by-side ablate workers behind docs/ablations.md: for each seed, the baseline run of
# runs/abl-single (training is deterministic on this CPU: the same config and seed give the same run)
# is copied in once it has finished, then `ablate --seeds S` trains this worker's switches. The last
# call (scripts in run.sh) reuses every run and prints ablate's own table.
set -euo pipefail
export OMP_NUM_THREADS=1
R=benchmarks/ablations/demo-gpt2026.toml
out=$1; shift
for seed in ${SEEDS:-1 2 3}; do
  until ls runs/abl-single/baseline-seed$seed-*/summary.json >/dev/null 2>&1; do sleep 20; done
  src=$(dirname runs/abl-single/baseline-seed$seed-*/summary.json)
  mkdir -p "$out"; [ -e "$out/$(basename "$src")" ] || cp -r "$src" "$out/"
  echo "load $(cat /proc/loadavg) seed $seed"
  python -m speedrun ablate --recipe $R --seeds "$seed," --out "$out" "$@"
done
