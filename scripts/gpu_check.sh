#!/usr/bin/env bash
# The GPU kit: run weir's GPU tests and the one-step benchmark on a GPU machine.
#
#   scripts/gpu_check.sh [WHEEL_DIR]     # default .whl (made by scripts/gpu_wheels.sh), optional
#
# Needs only python3 with torch (CUDA build) and transformers. weir is used from this checkout
# (PYTHONPATH), nothing is installed system-wide: weir's other dependencies come from the wheels
# in WHEEL_DIR, unpacked into a private directory ($WEIR_SITE, default /tmp/weir-site). No network.
# GPU_CHECK_BENCH=0 skips the benchmarks; GPU_CHECK_QUICK=0 runs it at full size (slower);
# GPU_CHECK_OUT names where results go (default gpu_check_out/). Where vLLM is installed (this
# Python, or WEIR_VLLM_PYTHON), the vLLM engine's tests and throughput rows run too.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-.whl}
PY=${PYTHON:-python3}
SITE=${WEIR_SITE:-/tmp/weir-site}
OUTDIR=${GPU_CHECK_OUT:-gpu_check_out}
mkdir -p "$OUTDIR"

"$PY" - <<'PYEOF' || exit 2
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (torch " + torch.__version__ + "); run this on a GPU machine")
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PYEOF

# Packages carried unpacked and packed again (gpu_wheels.sh makes Ray's so, to fit a transfer)
for archive in "$WHEELS"/*.tar.xz; do
  [ -e "$archive" ] || continue
  mkdir -p "$SITE"
  tar -C "$SITE" -xJf "$archive"
  echo "gpu_check: unpacked $(basename "$archive") into $SITE"
done

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

missing=$("$PY" - <<'PYEOF'
import importlib
mods = ["transformers", "pydantic", "yaml", "typer", "rich", "math_verify", "hypothesis", "pytest", "safetensors", "numpy"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
PYEOF
)
if [ -n "$missing" ]; then
  echo "gpu_check: missing Python modules: $missing; bring their wheels (scripts/gpu_wheels.sh) in $WHEELS" >&2
  exit 2
fi

export PYTHONUNBUFFERED=1
export GPU_CHECK_OUT="$OUTDIR"  # GPU tests that measure something write their figures here
# One process per test file: a device-side assert poisons the CUDA context of its process, and on
# the first GPU run one such assert failed every test after it.
status=0
: >"$OUTDIR/gpu_tests.log"
for file in tests/gpu/test_*.py; do
  name=$(basename "$file" .py)
  "$PY" -m pytest -q -p no:cacheprovider -m gpu "$file" --junitxml "$OUTDIR/$name.xml" \
    2>&1 | tee -a "$OUTDIR/gpu_tests.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || [ "$rc" = 5 ] || status=1  # 5: nothing collected (all skipped is 0)
done

if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
  quick=(--quick)
  [ "${GPU_CHECK_QUICK:-1}" = 0 ] && quick=()
  "$PY" benchmarks/gpu_step.py "${quick[@]}" --compare-cudnn --compare-graphs --grpo-steps "${GPU_CHECK_GRPO_STEPS:-20}" --ray \
    --out "$OUTDIR/gpu_step.json" 2>&1 | tee "$OUTDIR/gpu_step.log" || status=1
  # the trainer step: MFU three ways, layouts, profile, the fused head, and the colocated Ray step
  "$PY" benchmarks/gpu_trainer.py --ray --ray-modes defaults --budget-s "${GPU_CHECK_TRAINER_S:-240}" \
    --out "$OUTDIR/gpu_trainer.json" 2>&1 | tee "$OUTDIR/gpu_trainer.log" || status=1
fi
# vLLM, when this machine's Python (or $WEIR_VLLM_PYTHON) has it: the vLLM engine's tests and its
# throughput rows, with the servers started from that interpreter.
VLLM_PY=${WEIR_VLLM_PYTHON:-$PY}
if "$VLLM_PY" -W ignore -c "import vllm" >/dev/null 2>&1; then
  export WEIR_VLLM_PYTHON="$VLLM_PY"
  "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_vllm.py \
    --junitxml "$OUTDIR/vllm_tests.xml" 2>&1 | tee "$OUTDIR/vllm_tests.log" || status=1
  "$PY" benchmarks/engine_throughput.py --vllm 2>&1 | tee "$OUTDIR/vllm_engine.log" || status=1
else
  echo "gpu_check: vLLM is not installed for $VLLM_PY; skipping the vLLM engine (set WEIR_VLLM_PYTHON)"
fi
exit "$status"
