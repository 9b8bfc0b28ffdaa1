# Sourced by the set-up scripts. `install_into VENV ARGS...` installs ARGS (pip install's arguments)
# into VENV with uv, or with pip where uv cannot be had or fails (WEIR_NO_UV=1: pip only).
#
# Why uv: on a 2-core machine pip took 6.5 minutes over `make setup`'s packages, most of it CPU in
# pip itself (resolving one package at a time, compiling every module's bytecode up front); uv took
# 40 seconds for the same packages (parallel downloads, bytecode compiled on first import).
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
