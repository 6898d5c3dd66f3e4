#!/usr/bin/env bash
# The runs behind docs/benchmarks.md "The best CPU demo": today's demo (A) and its tuning arms, one after
# the other on a quiet host (nothing else running: the time budget plans from measured step times), then
# the table. Arms are recipes with `base = "demo"`, so the time budget still plans their step count
# (a value given on the command line would be the user's, trained exactly).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/demo-tuning}
mkdir -p "$OUT"
speedrun train --out "$OUT/A"
for arm in B C D E F G; do
  speedrun train --recipe "benchmarks/demo_tuning/$arm.toml" --out "$OUT/$arm"
done
python benchmarks/demo_tuning/table.py "$OUT"/A "$OUT"/B "$OUT"/C "$OUT"/D "$OUT"/E "$OUT"/F "$OUT"/G
