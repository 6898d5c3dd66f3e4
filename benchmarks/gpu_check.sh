#!/usr/bin/env bash
# One command for a lent GPU: install speedrun (and the dependencies the image lacks) from a wheel
# folder without touching the image's packages, then run the GPU tests, `speedrun bench` for four
# recipes (with TORCH_LOGS=recompiles,graph_breaks) and the Muon op count, under one deadline, every
# result into one folder. Without CUDA the GPU parts are reported "skipped: no CUDA".
#
#   benchmarks/gpu_check.sh [--wheels DIR] [--out DIR] [--deadline SECONDS] [--python PY]
#
# --wheels DIR  wheels from benchmarks/build_gpu_wheels.sh: installed with
#               `pip install --no-index --no-deps --target OUT/site` (only distributions the image does
#               not already have, plus speedrun itself); without it, the speedrun importable now (or
#               this checkout's src/) is used.
# --out DIR     results folder (default gpu-check-<UTC time>): summary.txt, env.txt, one log per part,
#               pytest-gpu.xml, bench-<recipe>.json.
# --deadline S  overall limit in seconds (default 540); each part gets at most what is left.
# --recipes "A B"  recipes for `speedrun bench` (default: two 2024-family and two gpt2026 recipes).
# --bench-limit S  seconds per bench (default 240: a gpt2026 recipe compiles for ~150 s on an H200); every 30 s each bench writes its Python stacks to
#               stacks-<recipe>.txt (benchmarks/with_stacks.py) and logs dynamo/inductor phases with times.
# --pytest-limit S seconds for `pytest -m gpu` (default 300; 0 skips it).
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
BENCH_LIMIT=240 PYTEST_LIMIT=300
RECIPES="record-2025-01 stages-2025-12 banks-2026-01 flex-2024-11" WHEELS="" OUT="gpu-check-$(date -u +%Y%m%dT%H%M%SZ)" DEADLINE=540 PY=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --deadline) DEADLINE=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --recipes) RECIPES=$2; shift 2 ;;
    --bench-limit) BENCH_LIMIT=$2; shift 2 ;;
    --pytest-limit) PYTEST_LIMIT=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
for n in "$DEADLINE" "$BENCH_LIMIT" "$PYTEST_LIMIT"; do
  case "$n" in ''|*[!0-9]*) echo "gpu_check.sh: --deadline, --bench-limit and --pytest-limit take whole seconds" >&2; exit 2 ;; esac
done
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
FAILED=0

say() { echo "$*" | tee -a "$OUT/summary.txt"; }
left() { echo $((DEADLINE - ($(date +%s) - START))); }

# part NAME LIMIT CMD...: run CMD with at most min(LIMIT, time left) seconds, log to OUT/NAME.log
part() {
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  [ "$budget" -lt "$limit" ] && limit=$budget
  if [ "$limit" -le 5 ]; then say "$name: skipped: deadline reached"; FAILED=1; return; fi
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$? secs=$(($(date +%s) - t0))
  if [ $rc -eq 0 ]; then say "$name: ok (${secs}s)"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then say "$name: timeout after ${limit}s"; FAILED=1
  else say "$name: failed rc=$rc (${secs}s), see $name.log"; FAILED=1; fi
}

: >"$OUT/summary.txt"
say "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown) deadline ${DEADLINE}s"

# ---- install
if [ -n "$WHEELS" ]; then
  TARGET=$OUT/site
  mkdir -p "$TARGET"
  picks=()
  for whl in "$WHEELS"/*.whl; do
    [ -e "$whl" ] || continue
    dist=$(basename "$whl" | cut -d- -f1)
    if [ "$dist" != speedrun ] && "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null; then
      continue  # the image has it: never shadow the image's packages
    fi
    picks+=("$whl")
  done
  if [ ${#picks[@]} -eq 0 ]; then say "install: failed: no wheel to install in $WHEELS"; exit 1; fi
  if "$PY" -m pip install --no-index --no-deps --target "$TARGET" "${picks[@]}" >"$OUT/install.log" 2>&1; then
    say "install: ok (${#picks[@]} wheels into $TARGET)"
  else
    say "install: failed, see install.log"; exit 1
  fi
  export PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH}
  export PATH=$TARGET/bin:$PATH
elif ! "$PY" -c "import speedrun" 2>/dev/null; then
  export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}
  say "install: skipped (no --wheels): using $REPO/src"
else
  say "install: skipped (no --wheels): using $("$PY" -c 'import speedrun; print(speedrun.__file__)')"
fi
"$PY" -c "import speedrun" 2>>"$OUT/summary.txt" || { say "speedrun does not import"; exit 1; }

# ---- environment
{
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('cuda available', torch.cuda.is_available()); print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
  command -v nvidia-smi >/dev/null && nvidia-smi
} >"$OUT/env.txt" 2>&1

# ---- GPU parts
if grep -qx "cuda available True" "$OUT/env.txt"; then  # read above: one torch import less (~3 s of CPU)
  if [ "$PYTEST_LIMIT" -gt 0 ]; then
    part pytest-gpu "$PYTEST_LIMIT" "$PY" -m pytest -m gpu -n 0 -v -p no:cacheprovider --durations=0 \
      --junitxml="$OUT/pytest-gpu.xml" tests
  else
    say "pytest-gpu: skipped (--pytest-limit 0)"
  fi
  for recipe in $RECIPES; do
    part "bench-$recipe" "$BENCH_LIMIT" env TORCH_LOGS=recompiles,graph_breaks,dynamo,inductor \
      TORCH_LOGS_FORMAT="%(asctime)s %(name)s %(message)s" \
      "$PY" "$REPO/benchmarks/with_stacks.py" 30 "$OUT/stacks-$recipe.txt" speedrun bench --recipe "$recipe" \
      --steps 5 --warmup 2 --device cuda --json "$OUT/bench-$recipe.json"
  done
  MUON_DEVICE=cuda
else
  say "pytest-gpu: skipped: no CUDA"
  for recipe in $RECIPES; do
    say "bench-$recipe: skipped: no CUDA"
  done
  MUON_DEVICE=meta
fi
part muon-ops 60 "$PY" "$REPO/benchmarks/bench_muon_ops.py" --recipe record-2025-01 --device "$MUON_DEVICE"

say "done in $(($(date +%s) - START))s; results in $OUT"
exit $FAILED
