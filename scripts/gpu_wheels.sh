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
# Liger's Triton kernels (pure Python, 0.9 MB) for train.fuse=liger and its GPU test
# (tests/gpu/test_varlen_fuse_gpu.py); not installed here (it requires triton), so pinned here.
# GPU_WHEELS_LIGER=0 leaves it out.
if [ "${GPU_WHEELS_LIGER:-1}" != 0 ]; then
  "$PY" -m pip download -q --no-deps -d "$DIR" "liger-kernel==${LIGER_VERSION:-0.8.5}" \
    || echo "gpu_wheels: liger-kernel not downloaded; skipped" >&2
fi
# Ray, for the colocated Ray run (tests/gpu/test_colocated_ray.py, benchmarks/gpu_step.py --ray);
# GPU_WHEELS_RAY=0 leaves it out. Its wheel (79 MB) is more than a 64 MiB transfer takes, so it is
# unpacked without the parts weir never imports (Java jars, RLlib, Data, Serve, LLM) and packed
# again as ray-VERSION.tar.xz (about 30 MB), which gpu_check.sh unpacks into its site directory.
# Its dependencies a torch image lacks come as wheels; the rest (click, filelock, msgpack,
# protobuf, requests, aiohttp) are already there.
if [ "${GPU_WHEELS_RAY:-1}" != 0 ]; then
  if version=$("$PY" -c "import importlib.metadata as m; print(m.version('ray'))" 2>/dev/null); then
    tmp=$(mktemp -d)
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$tmp" "ray==$version" \
      jsonschema jsonschema-specifications referencing rpds-py
    mv "$tmp"/jsonschema*.whl "$tmp"/referencing*.whl "$tmp"/rpds_py*.whl "$DIR"/
    mkdir "$tmp/site"
    (cd "$tmp/site" && unzip -q "$tmp"/ray-*.whl && rm -rf ray/jars ray/rllib ray/data ray/serve ray/llm)
    tar -C "$tmp/site" -cf - . | xz -6 -T0 >"$DIR/ray-$version.tar.xz"
    rm -rf "$tmp"
  else
    echo "gpu_wheels: ray is not installed in $PY; skipped" >&2
  fi
fi
ls -l "$DIR"
