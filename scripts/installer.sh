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

# `compile_bytecode VENV [DIR...] [-- MODULE...]` writes, now, the .pyc files of each DIR and of
# every module that importing the MODULEs loads in VENV (a name ending in ".*": the package and all
# its modules). Without them each process compiles every module it imports from source, and where
# PYTHONDONTWRITEBYTECODE is set (CI's machines set it) it does so again in every process, since
# nothing is written back: `import torch, transformers` took 18 s of CPU without .pyc files and 8 s
# with them on the 2-core AVX2 EPYC, and the test suite starts hundreds of processes. Only what
# weir's processes import, not whole environments: compileall over .venv took 82 s there for some
# 30,000 files, of which a weir process imports about 3,300. `make test` lets its processes write
# the .pyc of whatever else they import (the Makefile says why). Up-to-date files are skipped.
compile_bytecode() {
  local venv=$1
  shift
  local dirs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do dirs+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  if [ ${#dirs[@]} -gt 0 ]; then
    "$venv/bin/python" -m compileall -q -j 0 "${dirs[@]}" >/dev/null 2>&1 || true
  fi
  [ $# -gt 0 ] || return 0
  "$venv/bin/python" -W ignore - "$@" >/dev/null 2>&1 <<'PY' || true
import compileall, importlib, pkgutil, sys

sys.dont_write_bytecode = False  # each import writes its .pyc as it compiles the module


def package_modules(name):
    names = []
    try:  # a subpackage that fails to import is skipped; any other error ends the walk
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, name + ".", onerror=lambda _: None):
            names.append(info.name)
    except BaseException:
        pass
    return names


for name in sys.argv[1:]:
    for module in package_modules(name[:-2]) if name.endswith(".*") else [name]:
        try:
            importlib.import_module(module)
        except BaseException:  # an optional dependency missing, a module for another platform
            pass
for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None)
    if path and path.endswith(".py"):
        compileall.compile_file(path, quiet=2)
PY
}
