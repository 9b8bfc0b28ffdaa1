#!/usr/bin/env bash
# Download, on a machine with network, the wheels scripts/gpu_check.sh needs on a bare GPU machine
# that has only torch, transformers and the usual scientific packages (no network there).
#   scripts/gpu_wheels.sh [DIR]        # default .whl; versions pinned to this checkout's .venv
# Wheels are for CPython 3.12 on x86-64 Linux (PY_VERSION to change). Already-present packages on
# the GPU machine are not touched: gpu_check.sh installs these into a private target directory.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
PY_VERSION=${PY_VERSION:-3.12}
# weir's own dependencies a torch+transformers image usually lacks, plus the test tools
NAMES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions pyyaml typer
       click rich markdown-it-py mdurl pygments shellingham math-verify latex2sympy2-extended
       antlr4-python3-runtime hypothesis sortedcontainers pytest pluggy iniconfig packaging
       peft accelerate psutil)
mkdir -p "$DIR"
for name in "${NAMES[@]}"; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null) || {
    echo "gpu_wheels: $name is not installed in $PY; skipped" >&2; continue; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DIR" "$name==$version" \
    || "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR" "$name==$version"
done
# Ray and everything it depends on, for the colocated Ray run (tests/gpu/test_colocated_ray.py,
# benchmarks/gpu_step.py --ray); GPU_WHEELS_RAY=0 leaves it out
if [ "${GPU_WHEELS_RAY:-1}" != 0 ]; then
  if version=$("$PY" -c "import importlib.metadata as m; print(m.version('ray'))" 2>/dev/null); then
    "$PY" -m pip download -q --only-binary=:all: --python-version "$PY_VERSION" \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$DIR" "ray==$version" \
      || echo "gpu_wheels: could not download ray $version and its dependencies" >&2
  else
    echo "gpu_wheels: ray is not installed in $PY; skipped" >&2
  fi
fi
# A machine that receives at most so much per transfer (64 MiB on the tool this kit was first run
# with) gets the wheels in several: a wheel larger than GPU_WHEELS_PART_MB (default 40) is cut into
# parts, part k in DIR.part<k>/ with its SHA-256, and gpu_check.sh joins and checks them. Carry DIR in
# one transfer and each DIR.part<k> in its own, to the same checkout; GPU_WHEELS_PART_MB=0 cuts none.
PART_MB=${GPU_WHEELS_PART_MB:-40}
rm -rf "$DIR".part*
if [ "$PART_MB" != 0 ]; then
  for whl in "$DIR"/*.whl; do
    size=$(stat -c %s "$whl")
    [ "$size" -gt $((PART_MB * 1024 * 1024)) ] || continue
    name=$(basename "$whl")
    tmp=$(mktemp -d)
    split -b "${PART_MB}M" -d -a 2 "$whl" "$tmp/$name.part-"
    k=1
    for part in "$tmp"/*; do
      mkdir -p "$DIR.part$k"
      mv "$part" "$DIR.part$k/"
      k=$((k + 1))
    done
    sha256sum "$whl" | awk '{print $1}' >"$DIR.part1/$name.sha256"
    rm -rf "$tmp" "$whl"
    echo "gpu_wheels: $name ($((size / 1024 / 1024)) MiB) cut into $((k - 1)) parts in $DIR.part1..$((k - 1))"
  done
fi
ls "$DIR" "$DIR".part* 2>/dev/null
