#!/usr/bin/env bash
# The trainer-step device check of issue 35, sized for one call of at most 9.5 minutes on one H100 (run it with timeout_s 600):
#
#   OUT=/some/dir scripts/gpu_trainer_check.sh [WHEEL_DIR]     # default .whl (scripts/gpu_wheels.sh)
#
# 1. the fused-head GPU tests (each log-prob kernel, the Triton one included, against the reference);
# 2. benchmarks/gpu_trainer.py at both shapes: the defaults (two warm-up steps, three timed) beside
#    the old defaults, automatic dynamic shapes for the compiled graphs and the Triton head kernel
#    (and its block sizes alone: benchmarks/gpu_timing.triton_block_sweep);
#    then the 0.5B defaults again in a process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#    (the allocator's cudaMalloc calls over the timed steps are printed beside each figure), and
#    beside them Inductor's autotuned matmuls with their epilogues (copy_compile_gemm);
# 3. the colocated Ray step (engine weights parked in host memory, the lazy wake) and with the
#    engine keeping its weights (the default), and the weight sync's seconds per GB; then, if time
#    is left, the one-rank FSDP2 step with compiled layers (fsdp_compile);
# 4. the LoRA and colocated-Ray GPU tests, which had not passed on the code since 2026-11-27.
#
# Each step runs under `timeout` and writes to $OUT; what it printed is summed up at the end.
# Needs python3 with a CUDA torch and transformers; the rest comes from WHEEL_DIR (no network).
set -u
cd "$(dirname "$0")/.."
WHEELS=${1:-.whl}
OUT=${OUT:-gpu_check_out}
S=${WEIR_SITE:-/tmp/weir-site}
mkdir -p "$OUT" "$S"
T0=$(date +%s)
el() { echo $(($(date +%s) - T0)); }
for a in "$WHEELS"/*.tar.xz; do [ -e "$a" ] && tar -C "$S" -xJf "$a"; done
python3 -m pip install -q --no-index --no-deps --no-compile --target "$S" "$WHEELS"/*.whl 2>&1 | tail -2
export PYTHONPATH=$S:$PWD GPU_CHECK_OUT=$OUT PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$OUT/device.txt"
echo "setup $(el) s" | tee "$OUT/times.txt"

timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/gpu/test_fused_head_gpu.py \
  >"$OUT/head_tests.log" 2>&1
echo "head tests rc=$? $(el) s" | tee -a "$OUT/times.txt"
timeout 170 python3 benchmarks/gpu_trainer.py --budget-s 160 --no-profile --parts "" \
  --variants copy_compile_triton,copy_compile_autodyn,autocast_off \
  --out "$OUT/gpu_trainer.json" >"$OUT/gpu_trainer.log" 2>&1
echo "bench rc=$? $(el) s" | tee -a "$OUT/times.txt"
# at most 130 s, keeping 285 s for the Ray, LoRA and colocated parts after it
t=$((570 - 285 - $(el))); [ "$t" -gt 130 ] && t=130; [ "$t" -lt 60 ] && t=60
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $t python3 benchmarks/gpu_trainer.py \
  --shapes 0.5b --budget-s $((t - 5)) --no-profile --parts "" --variants copy_compile_gemm --head-rows 0 \
  --out "$OUT/gpu_trainer_expandable.json" >"$OUT/gpu_trainer_expandable.log" 2>&1
echo "bench expandable_segments rc=$? $(el) s" | tee -a "$OUT/times.txt"
timeout 165 python3 benchmarks/gpu_trainer.py --shapes "" --ray --ray-modes defaults,fsdp_compile --budget-s 160 \
  --out "$OUT/gpu_trainer_ray.json" >"$OUT/gpu_trainer_ray.log" 2>&1
echo "ray rc=$? $(el) s" | tee -a "$OUT/times.txt"
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/gpu/test_lora_gpu.py \
  >"$OUT/lora_tests.log" 2>&1
echo "lora rc=$? $(el) s" | tee -a "$OUT/times.txt"
left=$((570 - $(el)))
if [ "$left" -gt 60 ]; then
  timeout "$left" python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    tests/gpu/test_colocated_ray.py >"$OUT/colocated_tests.log" 2>&1
  echo "colocated rc=$? $(el) s" | tee -a "$OUT/times.txt"
fi
cat "$OUT/device.txt"
for f in head_tests lora_tests colocated_tests; do [ -f "$OUT/$f.log" ] && tail -n 2 "$OUT/$f.log"; done
grep -hE "^target|main:|variant|train.fuse|^ray step|^head|^one FSDP2|^fsdp_compile|^local:" "$OUT/gpu_trainer.log" \
  "$OUT/gpu_trainer_expandable.log" "$OUT/gpu_trainer_ray.log"
