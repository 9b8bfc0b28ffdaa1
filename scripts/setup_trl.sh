#!/usr/bin/env bash
# Create .venv-trl: TRL (1.16) for benchmarks/vs_trl.py, in an environment of its own so that weir's
# .venv never takes TRL's pins. Same CPU torch and the same transformers as .venv, so both sides run
# the same kernels on the same model. Never a CUDA torch on a machine without an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-trl}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TRL_VERSION=${TRL_VERSION:-1.16.*}
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-$(.venv/bin/python -c 'import transformers; print(transformers.__version__)' 2>/dev/null || echo "")}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" install "torch==$TORCH_VERSION" ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"}
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    "$VENV/bin/python" -W ignore -c "import torch, sys; sys.exit(0 if not torch.version.cuda else 1)" || {
      echo "setup_trl: a CUDA build of torch was installed on a machine without a GPU;" >&2
      echo "           set TORCH_CPU_INDEX to a CPU wheel index and run again" >&2
      exit 1
    }
  fi
fi
"${PIP[@]}" install "trl==$TRL_VERSION" ${TRANSFORMERS_VERSION:+"transformers==$TRANSFORMERS_VERSION"} "torch==$TORCH_VERSION"
echo "setup_trl: ready ($("$VENV/bin/python" -c 'import torch, transformers, trl; print("torch", torch.__version__, "transformers", transformers.__version__, "trl", trl.__version__)'))"
