#!/usr/bin/env bash
# Build .venv-tf-old: weir's .venv with the oldest transformers weir supports (the lower bound of
# `transformers>=` in pyproject.toml) in front of it, for `make test-tf-old`. Its own site-packages
# hold that release and only what it needs at other versions than .venv has (huggingface-hub < 2);
# torch, tokenizers, peft ... are .venv's, reached through a .pth. So the run differs from .venv in
# transformers alone, and the set-up installs two wheels. Idempotent: a second run checks the version.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TF_OLD_VENV:-.venv-tf-old}
BASE=${VENV_BASE:-.venv}
OLDEST=$("$BASE/bin/python" -c '
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(re.search(r">=([\d.]+)", d).group(1) for d in deps if d.startswith("transformers")))')
have() { "$VENV/bin/python" -c 'import transformers; print(transformers.__version__)' 2>/dev/null || true; }

if [[ "$(have)" != "$OLDEST"* ]]; then
  rm -rf "$VENV"
  "$BASE/bin/python" -m venv --without-pip "$VENV"  # .venv's pip installs into it (no ensurepip)
  SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  BASE_SITE=$(cd "$BASE" && "$PWD/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # after the venv's own site-packages: its transformers wins, everything else comes from .venv
  echo "import site; site.addsitedir('$BASE_SITE')" > "$SITE/zz_weir_base_venv.pth"
  "$BASE/bin/python" -m pip --python "$VENV/bin/python" --disable-pip-version-check -q \
    install --no-compile "transformers==$OLDEST.*"
fi
source scripts/installer.sh
compile_bytecode "$VENV" -- transformers.modeling_utils transformers.models.qwen3.modeling_qwen3 \
  transformers.models.llama.modeling_llama  # its transformers (scripts/installer.sh says why)
echo "setup-tf-old: ready (transformers $(have) over $BASE)"
