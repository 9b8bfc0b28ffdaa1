# Sourced by the set-up scripts. `install_into VENV ARGS...` installs ARGS (pip install's arguments)
# into VENV with uv, or with pip where uv cannot be had or fails (WEIR_NO_UV=1: pip only).
#
# Why uv: on a 2-core machine pip took 6.5 minutes over `make setup`'s packages, most of it CPU in
# pip itself (resolving one package at a time, compiling every module's bytecode up front); uv took
# 40 seconds for the same packages (parallel downloads, bytecode left to compile_bytecode below).
#
# uv reads neither pip's configuration nor its constraints, so torch is pinned to the build already
# in VENV (installed by pip beforehand, from the machine's CPU wheel where there is one): a
# dependency asking for another torch fails to resolve instead of pulling a CUDA build. pip's
# environment settings for the index, extra links and certificates are passed on.

_uv_ready() {
  local venv=$1
  [ -x "$venv/bin/uv" ] || "$venv/bin/python" -m pip --disable-pip-version-check -q install "uv>=0.5,<1" \
    >/dev/null 2>&1 || return 1
  "$venv/bin/python" -W ignore -c 'import importlib.metadata as m
try: print("torch==" + m.version("torch"))
except m.PackageNotFoundError: pass' > "$venv/weir-pins.txt"
}

install_into() {
  local venv=$1
  shift
  if [ -z "${WEIR_NO_UV:-}" ] && _uv_ready "$venv"; then
    if SSL_CERT_FILE=${SSL_CERT_FILE:-${PIP_CERT:-}} UV_DEFAULT_INDEX=${UV_DEFAULT_INDEX:-${PIP_INDEX_URL:-}} \
        UV_FIND_LINKS=${UV_FIND_LINKS:-${PIP_FIND_LINKS:-}} \
        "$venv/bin/uv" pip install --python "$venv/bin/python" -q --constraint "$venv/weir-pins.txt" "$@"; then
      return 0
    fi
    echo "setup: uv could not install $*; trying pip" >&2
  fi
  "$venv/bin/python" -m pip --disable-pip-version-check -q install "$@"
}

# `compile_bytecode VENV [DIR...]` writes the .pyc files of VENV's site-packages (and of DIRs) now,
# on every core. Without them each process compiles every module it imports from source: where
# PYTHONDONTWRITEBYTECODE is set (CI's machines set it) it does so again in every process, since
# nothing is written back. Measured on the 2-core AVX2 EPYC: `import torch, transformers` took
# 18 s of CPU without .pyc files and 8 s with them, and the test suite starts hundreds of
# processes (Ray actors, vLLM's three per server); compiling .venv took 82 s. Files that do not
# compile under this Python (templates, other versions' syntax in test modules) are skipped.
compile_bytecode() {
  local venv=$1
  shift
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$venv/bin/python" -m compileall -q -j 0 "$site" "$@" >/dev/null 2>&1 || true
}
