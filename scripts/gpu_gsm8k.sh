#!/usr/bin/env bash
# GSM8K with SmolLM2-135M-Instruct on a bare GPU machine (benchmarks/gsm8k_gpu.py), in two transfers.
#
#   scripts/gpu_gsm8k.sh pack            # here (network, .venv): build .gpu_carry/a and .gpu_carry/b
#   scripts/gpu_gsm8k.sh stage           # GPU call 1, carrying .gpu_carry/a: install, check CUDA
#   scripts/gpu_gsm8k.sh run [ARGS...]   # GPU call 2, carrying .gpu_carry/b: the run (ARGS go to
#                                        # benchmarks/gsm8k_gpu.py; default: 240 s of training)
#
# The model is PyPI's Q4_1 GGUF (98 MB, sha256 pinned in weir/train/fetch.py): the smallest exact
# carry of the weights weir trains (they are its dequantized values; as float32 or bfloat16
# safetensors they take 540 or 270 MB, and xz saves little on 4-bit data). A transfer takes 64 MiB,
# so the file goes in two halves: a/ holds the first with the wheels weir needs there (weir's
# dependencies a torch+transformers image lacks, the gguf package) and GSM8K (xz); b/ the second.
# `stage` leaves a/ installed in the repository's ignored .gpu_carry/, which the next call on the
# same (still warm) machine finds; `run` joins the halves, checks the SHA-256 and converts.
# Call 2 must follow call 1 while the machine is warm; a cold machine has lost a/ (`run` says so).
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=${GPU_GSM8K_CARRY:-.gpu_carry}  # GPU_GSM8K_CARRY: another folder (a CPU rehearsal)
SITE=$CARRY/site
PY=${PYTHON:-python3}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

pack() {
  local venv=${VENV:-.venv}
  rm -rf "$CARRY/a" "$CARRY/b"
  mkdir -p "$CARRY/a/wheels" "$CARRY/b"
  local gguf
  gguf=$("$venv/bin/python" -c "from weir.train.fetch import download_gguf; print(download_gguf('smollm2-135m-instruct'))")
  local size half
  size=$(stat -c %s "$gguf")
  half=$(((size + 1) / 2))
  head -c "$half" "$gguf" >"$CARRY/a/$GGUF_NAME.part1"
  tail -c +"$((half + 1))" "$gguf" >"$CARRY/b/$GGUF_NAME.part2"
  GPU_WHEELS_RAY=0 PYTHON="$venv/bin/python" bash scripts/gpu_wheels.sh "$CARRY/a/wheels" >/dev/null
  # only what this run imports: the test tools, peft and Ray stay behind
  rm -f "$CARRY"/a/wheels/{hypothesis,sortedcontainers,pytest,pluggy,iniconfig,peft}-*.whl
  "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$CARRY/a/wheels" \
    "gguf==$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  local data
  data=$("$venv/bin/python" -c "from weir.tasks.gsm8k import default_data_dir; print(default_data_dir())")
  tar -C "$data" -cf - train.jsonl test.jsonl | xz -6 >"$CARRY/a/gsm8k.tar.xz"
  du -sh "$CARRY/a" "$CARRY/b"
  echo "pack: call 1 carries $CARRY/a, call 2 carries $CARRY/b (each under 64 MiB)"
}

stage() {
  [ -f "$CARRY/a/$GGUF_NAME.part1" ] || { echo "stage: no $CARRY/a (carry it: run with carry=[\"$CARRY/a\"])" >&2; exit 2; }
  # GPU_GSM8K_CPU=1: a CPU rehearsal of the same steps (pack with PY_VERSION set to this Python's)
  "$PY" -c "import torch, transformers, sys, os; print('stage: torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0)); sys.exit(0 if torch.cuda.is_available() or os.environ.get('GPU_GSM8K_CPU') else 3)"
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$CARRY"/a/wheels/*.whl
  mkdir -p "$CARRY/gsm8k"
  xz -dc "$CARRY/a/gsm8k.tar.xz" | tar -C "$CARRY/gsm8k" -xf -
  PYTHONPATH="$SITE:$PWD" "$PY" -c "import weir, gguf, math_verify, pydantic; print('stage: weir imports from', weir.__file__)"
  echo "stage: ready; now scripts/gpu_gsm8k.sh run, carrying $CARRY/b"
}

run() {
  [ -d "$SITE" ] && [ -f "$CARRY/a/$GGUF_NAME.part1" ] || {
    echo "run: $CARRY/a is not staged here (the machine went cold?); call 'stage' again first" >&2; exit 2; }
  [ -f "$CARRY/b/$GGUF_NAME.part2" ] || { echo "run: no $CARRY/b (carry it)" >&2; exit 2; }
  cat "$CARRY/a/$GGUF_NAME.part1" "$CARRY/b/$GGUF_NAME.part2" >"$CARRY/$GGUF_NAME"
  echo "$SHA256  $CARRY/$GGUF_NAME" | sha256sum -c -
  local out=${OUT:-gpu_gsm8k_out}
  mkdir -p "$out"
  WEIR_GSM8K_DIR="$PWD/$CARRY/gsm8k" PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 \
    "$PY" benchmarks/gsm8k_gpu.py --model "$CARRY/$GGUF_NAME" --workdir "$CARRY/work" \
    --out "$out/gsm8k_gpu.json" "$@" 2>&1 | tee "$out/gsm8k_gpu.log"
}

case "${1:-}" in
  pack) pack ;;
  stage) stage ;;
  run) shift; run "$@" ;;
  *) echo "usage: scripts/gpu_gsm8k.sh pack | stage | run [ARGS...]" >&2; exit 2 ;;
esac
