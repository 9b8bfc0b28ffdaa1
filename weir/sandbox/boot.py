"""The ``-c`` programs that start the sandboxed launcher and the judge, compiled once per interpreter.

Both are stdlib-only Python (`weir.sandbox.wire` plus the launcher's or the judge's own code) that
must reach a fresh interpreter without a file the program could change. Compiling them costs more
than the rest of an interpreter's start-up, so they are compiled once by the sandbox's own
interpreter (byte code is specific to its version) and passed as marshalled code in the command
line; where that compile fails, the source is passed instead.
"""

from __future__ import annotations

import base64
import functools
import json
import subprocess
from pathlib import Path

__all__ = ["boot_program", "source_of", "import_path"]

_HERE = Path(__file__).parent
_COMPILE = (
    "import sys, marshal, binascii, json\n"
    "srcs = json.loads(sys.stdin.read())\n"
    "code = tuple(compile(s, n, 'exec', dont_inherit=True) for n, s in srcs)\n"
    "sys.stdout.write(binascii.b2a_base64(marshal.dumps(code), newline=False).decode())\n"
)


@functools.lru_cache(maxsize=8)
def source_of(module: str) -> str:
    """The source text of one of this package's stdlib-only modules (``wire``, ``judge``)."""
    return (_HERE / f"{module}.py").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=32)
def _compiled(python: str, sources: tuple[tuple[str, str], ...]) -> str | None:
    """base64 of the marshalled code objects of `sources` compiled by `python`, or None."""
    try:
        r = subprocess.run(
            [python, "-I", "-S", "-c", _COMPILE],
            input=json.dumps(sources),
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0 or not r.stdout:
        return None
    try:
        base64.b64decode(r.stdout, validate=True)
    except ValueError:
        return None
    return r.stdout


@functools.lru_cache(maxsize=8)
def import_path(python: str) -> list[str]:
    """`python`'s ``sys.path`` in isolated mode (site-packages included): the judge starts without
    ``site`` (a third of its start-up) and takes this path instead."""
    try:
        r = subprocess.run(
            [python, "-I", "-c", "import sys, json; print(json.dumps(sys.path))"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
        path = json.loads(r.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    return [p for p in path if isinstance(p, str) and p]


def boot_program(python: str, main: tuple[str, str], namespace: str) -> str:
    """A ``-c`` program for `python` that makes `weir.sandbox.wire` a module object ``wire`` and
    runs `main` (name, source) with it in a fresh namespace whose ``__name__`` is `namespace`."""
    sources = (("<weir-wire>", source_of("wire")), main)
    blob = _compiled(python, sources)
    if blob is not None:
        load = f"import marshal as _m, binascii as _b\n_w, _c = _m.loads(_b.a2b_base64({blob!r}))\n"
    else:
        load = (
            f"_w = compile({sources[0][1]!r}, {sources[0][0]!r}, 'exec')\n"
            f"_c = compile({main[1]!r}, {main[0]!r}, 'exec')\n"
        )
    return (
        load + "import sys as _s\n"
        "wire = type(_s)('wire')\n"
        "exec(_w, wire.__dict__)\n"
        f"exec(_c, {{'__name__': {namespace!r}, 'wire': wire, '__builtins__': __builtins__}})\n"
    )
