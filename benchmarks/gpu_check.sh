#!/usr/bin/env bash
# One command for a lent GPU (issues 34, 44), at most 8 minutes: install speedrun from a wheel folder without
# touching the image's packages, then the speed layer's A/B, each part under its own time limit and all
# under one deadline, each ratio printed (and written to summary.txt) as its part ends:
#   0. `speedrun doctor` (with CUDA: `--recipe record-2026-07`): the host's preflight; its warn and fail
#      lines go into the summary (a fail is reported, and the parts still run)
#   1. `speedrun bench --recipe record-2026-07 --stage 3`: the plain arm (stage 3 has the anchor and the
#      memory figure); with --full the three stages, 3 first
#   2. the same with CUDA graphs by hand (SPEEDRUN_GRAPHS=manual, speedrun/perf/graphs.py, #92's way)
#   3. the same with torch.compile's cudagraph trees (SPEEDRUN_GRAPHS=trees); 2 and 3 each print
#      `graphs WAY ... plain/graphs R` against part 1 (benchmarks/graph_ratio.py): the loser is deleted
#   3b. `speedrun bench --recipe anvil-2026-08 --stage 3` (#92) with a twentieth of its table (one GPU
#      holds no more): today's record's algorithm compiled and timed on the device
#   4. eager against compiled optimizer updates on record-2026-07's stage 3
#      (benchmarks/bench_compiled_updates.py; speedrun/perf/compiled_updates.py)
#   with --full only: a CUDA memory snapshot of stage 3 (benchmarks/memory_snapshot.py) and
#      `speedrun bench --recipe stages-2025-12 --stage 3`
#   5. `pytest -m gpu` of the speed layer's tests (graphs, optimizer graphs, kernels; --full: every test)
#   6. the Muon op count (benchmarks/bench_muon_ops.py)
#   7. each speed-layer kernel against its compiled twin (benchmarks/bench_kernels.py), one part per
#      kernel, last, so that they never starve the measurements above
# Each finished stage prints its line (ms/step, tok/s, compile, peak; the record's figure from
# src/speedrun/tools/anchors.toml and ours/record) into summary.txt as it ends, so a partial run still
# answers. Without CUDA the GPU parts are reported "skipped: no CUDA".
#
#   benchmarks/gpu_check.sh [--wheels DIR] [--out DIR] [--deadline SECONDS] [--python PY] [--full] [--parts LIST]
#                           [--steps N] [--warmup N] [--bench-limit S] [--pytest-limit S] [--cpu-overrides DIR]
#
# --wheels DIR  wheels from benchmarks/build_gpu_wheels.sh: installed with
#               `pip install --no-index --no-deps --target OUT/site` (only distributions the image does
#               not already have, plus speedrun itself); without it, the speedrun importable now (or
#               this checkout's src/) is used.
# --out DIR     results folder (default gpu-check-<UTC time>): summary.txt, env.txt, one log per part,
#               bench-*.json, graphs-*.json, pytest-gpu.xml (--full: snapshot/ with snapshot.pickle for
#               https://pytorch.org/memory_viz, snapshot.json).
# --deadline S  overall limit in seconds (default 480); each part gets at most what is left. The part
#               limits add up to about 715 s, sized for cold compiles (~150 s per gpt2026 graph on an
#               H200): on a cold cache the deadline cuts from the end (kernels first); --full adds
#               about 400 s (raise the deadline with it).
# --parts LIST  comma-separated groups to run (default all): doctor,record,anvil,graphs,updates,pytest,
#               muon,kernels; e.g. a second call of the lease with `--parts kernels` when the first was cut.
# --full        also record-2026-07's stages 1 and 2, the memory snapshot and stages-2025-12's stage 3.
# --steps N, --warmup N  timed and untimed steps per stage (default 5 and 2; the first compiles; with
#               CUDA graphs the first captures and the second checks the replay against eager).
# --bench-limit S  seconds for part 1 (default 180; 270 with --full); parts 2 and 3 get 100 and 150; every
#               30 s each bench writes its Python stacks to stacks-<part>.txt (benchmarks/with_stacks.py).
# --pytest-limit S seconds for `pytest -m gpu` (default 45; 0 skips it).
# --cpu-overrides DIR  a test of the kit itself, not a measurement: without CUDA, run part 1 (and with
#               --full the snapshot and stages-2025-12) on the CPU anyway, each recipe with the key=value
#               lines of DIR/<recipe>.txt (tests/e2e/test_gpu_check.py).
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
BENCH_LIMIT="" PYTEST_LIMIT=45 STEPS=5 WARMUP=2 CPU_OVERRIDES="" FULL=0
PARTS=doctor,record,anvil,graphs,updates,pytest,muon,kernels
WHEELS="" OUT="gpu-check-$(date -u +%Y%m%dT%H%M%SZ)" DEADLINE=480 PY=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --deadline) DEADLINE=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --cpu-overrides) CPU_OVERRIDES=$2; shift 2 ;;
    --bench-limit) BENCH_LIMIT=$2; shift 2 ;;
    --pytest-limit) PYTEST_LIMIT=$2; shift 2 ;;
    --full) FULL=1; shift ;;
    --parts) PARTS=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
[ -n "$BENCH_LIMIT" ] || { [ "$FULL" = 1 ] && BENCH_LIMIT=270 || BENCH_LIMIT=180; }
for p in ${PARTS//,/ }; do
  case "$p" in doctor|record|anvil|graphs|updates|pytest|muon|kernels) ;;
    *) echo "gpu_check.sh: --parts takes doctor,record,anvil,graphs,updates,pytest,muon,kernels (not $p)" >&2; exit 2 ;;
  esac
done
wanted() { case ",$PARTS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
for n in "$DEADLINE" "$BENCH_LIMIT" "$PYTEST_LIMIT" "$STEPS" "$WARMUP"; do
  case "$n" in ''|*[!0-9]*) echo "gpu_check.sh: --deadline, --bench-limit, --pytest-limit, --steps and --warmup take whole numbers" >&2; exit 2 ;; esac
done
[ "$STEPS" -gt 0 ] || { echo "gpu_check.sh: --steps must be at least 1" >&2; exit 2; }
if [ -n "$CPU_OVERRIDES" ] && [ ! -d "$CPU_OVERRIDES" ]; then
  echo "gpu_check.sh: --cpu-overrides $CPU_OVERRIDES is not a folder" >&2; exit 2
fi
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
FAILED=0

say() { echo "$*" | tee -a "$OUT/summary.txt"; }
left() { echo $((DEADLINE - ($(date +%s) - START))); }

# part NAME LIMIT CMD...: run CMD with at most min(LIMIT, time left) seconds, log to OUT/NAME.log; its
# result lines (a bench's finished stages, the snapshot's) go to the summary as they are printed
part() {
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  [ "$budget" -lt "$limit" ] && limit=$budget
  if [ "$limit" -le 5 ]; then say "$name: skipped: deadline reached"; FAILED=1; return; fi
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" \
    | { grep --line-buffered -E '^(bench-stage|bench-kernel|memory_snapshot|compiled-updates|graphs) ' || true; } \
    | tee -a "$OUT/summary.txt"
  local rc=${PIPESTATUS[0]} secs=$(($(date +%s) - t0))
  if [ $rc -eq 0 ]; then say "$name: ok (${secs}s)"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then say "$name: timeout after ${limit}s"; FAILED=1
  else say "$name: failed rc=$rc (${secs}s), see $name.log"; FAILED=1; fi
}

: >"$OUT/summary.txt"
say "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) kit at commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown) deadline ${DEADLINE}s"

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
# which code the parts measure: this checkout (its commit, and whether it has uncommitted changes) or
# another installed speedrun (its place: the kit's commit says nothing of it)
MEASURED=$("$PY" -c "import speedrun, os; print(os.path.realpath(os.path.dirname(speedrun.__file__)))")
if [ "$MEASURED" = "$(realpath "$REPO/src/speedrun" 2>/dev/null)" ]; then
  dirty=""; [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ] && dirty=", with uncommitted changes"
  say "code: this checkout, commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)$dirty"
else
  say "code: the speedrun installed at $MEASURED, not this checkout (the kit's commit is not what it measures)"
fi

# ---- environment
{
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('cuda available', torch.cuda.is_available()); print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
  command -v nvidia-smi >/dev/null && nvidia-smi
} >"$OUT/env.txt" 2>&1

# ---- GPU parts
# overrides RECIPE: the lines of --cpu-overrides DIR/RECIPE.txt (none on a GPU)
overrides() {
  [ -n "$CPU_OVERRIDES" ] && [ -f "$CPU_OVERRIDES/$1.txt" ] && cat "$CPU_OVERRIDES/$1.txt"
  return 0
}
# bench NAME LIMIT RECIPE STAGES [GRAPHS [OVERRIDE...]]: `speedrun bench` of RECIPE's STAGES (with
# SPEEDRUN_GRAPHS=GRAPHS) and the part's overrides,
# with recompile and graph-break logs
bench() {
  local name=$1 limit=$2 recipe=$3 stages=$4 graphs=${5:-} ov
  mapfile -t ov < <([ $# -gt 5 ] && printf '%s\n' "${@:6}"; overrides "$recipe")  # the part's, then the CPU's
  part "$name" "$limit" env SPEEDRUN_GRAPHS="$graphs" TORCH_LOGS=recompiles,graph_breaks TORCH_LOGS_FORMAT="%(asctime)s %(name)s %(message)s" \
    "$PY" "$REPO/benchmarks/with_stacks.py" 30 "$OUT/stacks-$name.txt" speedrun bench --recipe "$recipe" \
    --stage "$stages" --steps "$STEPS" --warmup "$WARMUP" --device "$DEVICE" --json "$OUT/$name.json" "${ov[@]}"
}
DEVICE=""
if grep -qx "cuda available True" "$OUT/env.txt"; then  # read above: one torch import less (~3 s of CPU)
  DEVICE=cuda
elif [ -n "$CPU_OVERRIDES" ]; then
  DEVICE=cpu
  say "no CUDA: parts 1-3 run on the CPU with $CPU_OVERRIDES (a test of the kit, not a measurement)"
fi
if ! wanted doctor; then
  say "doctor: skipped (--parts)"
elif [ "$DEVICE" = cuda ]; then
  part doctor 30 "$PY" -m speedrun doctor --recipe record-2026-07
else
  part doctor 30 "$PY" -m speedrun doctor
fi
[ -f "$OUT/doctor.log" ] && grep -E '^(warn|fail) ' "$OUT/doctor.log" | sed 's/^/doctor: /' | tee -a "$OUT/summary.txt"
RECORD_STAGES=3
[ "$FULL" = 1 ] && RECORD_STAGES=3,1,2
if ! wanted record; then
  say "bench-record-2026-07: skipped (--parts)"
elif [ -n "$DEVICE" ]; then
  bench bench-record-2026-07 "$BENCH_LIMIT" record-2026-07 "$RECORD_STAGES"
else
  say "bench-record-2026-07: skipped: no CUDA"
fi
for way in manual trees; do  # the step's CUDA graphs, two ways, each against part 1 (perf/graphs.py)
  if ! wanted graphs; then
    say "graphs-$way: skipped (--parts)"
  elif [ "$DEVICE" = cuda ]; then
    limit=100; [ "$way" = trees ] && limit=150  # trees compile their own graph (another inductor mode)
    bench "graphs-$way" "$limit" record-2026-07 3 "$way"
    "$PY" "$REPO/benchmarks/graph_ratio.py" "$OUT/bench-record-2026-07.json" "$OUT/graphs-$way.json" "$way" \
      | tee -a "$OUT/summary.txt"
  else
    say "graphs-$way: skipped: no CUDA"
  fi
done
if ! wanted anvil; then
  say "bench-anvil-2026-08: skipped (--parts)"
elif [ "$DEVICE" = cuda ]; then
  # #92 on one GPU: its 84,602,880-row table needs 8 (dry-run: 181.2 GiB on one); a twentieth of it,
  # 4,230,144 rows, an estimated 65.6 GiB; the table pulled outside the compiled graph, no CUDA graphs
  bench bench-anvil-2026-08 150 anvil-2026-08 3 "" model.ngram.rows=4230144
elif [ -n "$DEVICE" ] && [ -f "$CPU_OVERRIDES/anvil-2026-08.txt" ]; then
  bench bench-anvil-2026-08 150 anvil-2026-08 3
else
  say "bench-anvil-2026-08: skipped: no CUDA"
fi
if ! wanted updates; then
  say "compiled-updates: skipped (--parts)"
elif [ "$DEVICE" = cuda ]; then
  part compiled-updates 60 "$PY" "$REPO/benchmarks/bench_compiled_updates.py" --recipe record-2026-07 --stage 3 \
    --steps "$STEPS" --warmup "$WARMUP" --device cuda
else
  say "compiled-updates: skipped: no CUDA"
fi
if [ "$FULL" = 1 ]; then
  if [ -n "$DEVICE" ]; then
    mapfile -t ov < <(overrides record-2026-07)
    part memory-snapshot 90 "$PY" "$REPO/benchmarks/memory_snapshot.py" --recipe record-2026-07 --stage 3 \
      --device "$DEVICE" --out "$OUT/snapshot" "${ov[@]}"
    bench bench-stages-2025-12-stage3 150 stages-2025-12 3
  else
    for name in memory-snapshot bench-stages-2025-12-stage3; do say "$name: skipped: no CUDA"; done
  fi
fi
if [ "$DEVICE" = cuda ]; then
  if ! wanted pytest; then
    say "pytest-gpu: skipped (--parts)"
  elif [ "$PYTEST_LIMIT" -gt 0 ]; then
    TESTS=(tests/unit/test_step_graphs.py tests/unit/test_optimizer_graphs.py tests/unit/test_perf_kernels.py)  # the speed layer's
    [ "$FULL" = 1 ] && TESTS=(tests)
    part pytest-gpu "$PYTEST_LIMIT" "$PY" -m pytest -m gpu -n 0 -v -p no:cacheprovider --durations=0 \
      --junitxml="$OUT/pytest-gpu.xml" "${TESTS[@]}"
  else
    say "pytest-gpu: skipped (--pytest-limit 0)"
  fi
  MUON_DEVICE=cuda
else
  say "pytest-gpu: skipped: no CUDA"
  MUON_DEVICE=meta
fi
if wanted muon; then
  part muon-ops 30 "$PY" "$REPO/benchmarks/bench_muon_ops.py" --recipe record-2025-01 --device "$MUON_DEVICE"
else
  say "muon-ops: skipped (--parts)"
fi
for kernel in gram ba_plus_caa softcapped_ce relu2_linear softcapped_prefix_ce sampled_softcapped_ce ngram_embed row_adam_rows; do  # the speed layer's A/B: kernel vs compiled twin
  if ! wanted kernels; then
    say "kernel-$kernel: skipped (--parts)"
  elif [ "$DEVICE" = cuda ]; then
    part "kernel-$kernel" 25 "$PY" "$REPO/benchmarks/bench_kernels.py" --only "$kernel"
  else
    say "kernel-$kernel: skipped: no CUDA"
  fi
done

say "done in $(($(date +%s) - START))s; results in $OUT"
exit $FAILED
