"""Languages the sandbox runs: how a program and its tests become files and a command.

A `Language` writes the program (and a harness around its tests) into the work directory and names
the command that runs it; the harness reports each test's verdict on its own line of a results file
(JSON), written as it goes, so the tests reached before a timeout still count. Python is built in;
another language is one more class with the same three members, registered in `LANGUAGES`.

The Python harness runs the program and then each test in one namespace (HumanEval's convention):
a test is a snippet of statements (``assert f(2) == 4``) that passes when it raises nothing. With
``guard`` it first installs an audit hook (PEP 578) that denies opening files outside the work
directory and the interpreter's own installation, writing outside the work directory, sockets,
new processes, signals to other processes and ctypes. The hook runs in the program's own interpreter:
it stops accidents and naive hostile code, not a determined attacker; the OS levels do that.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from weir.sandbox.isolation import Isolation

__all__ = ["Language", "Python", "LANGUAGES", "get_language", "DENIED_MARK", "STARTED_MARK"]

DENIED_MARK = "weir-sandbox denied:"
STARTED_MARK = ".weir_started"  # the harness's first act: without it the program never started


class Language(Protocol):
    """How to run programs of one language in a work directory."""

    name: str

    def prepare(
        self,
        workdir: Path,
        program: str,
        *,
        tests: Sequence[str] | None,
        args: Sequence[str],
        guard: bool,
        iso: Isolation,
    ) -> tuple[list[str], str | None]:
        """Write the files; return (the command, the results file name or None without tests)."""
        ...


_GUARD = r"""
def _weir_guard(work):
    import os, sys
    real = os.path.realpath
    work = real(work)
    reads = tuple({real(p) for p in (work, sys.prefix, sys.base_prefix, sys.exec_prefix,
                                    sys.base_exec_prefix)} | {"/usr/lib", "/usr/share/zoneinfo"})
    devices = {"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"}
    wflags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    denied = ("socket.", "subprocess.", "os.fork", "os.forkpty", "os.system", "os.exec",
              "os.posix_spawn", "os.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
              "ctypes.", "pty.", "os.setuid", "os.setgid", "resource.setrlimit", "resource.prlimit",
              "sys.remote_exec", "urllib.Request", "http.client.", "ftplib.", "smtplib.", "poplib.",
              "imaplib.", "nntplib.", "telnetlib.", "webbrowser.")
    path_events = {"os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.chown",
                   "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree",
                   "os.chflags", "os.lchflags", "os.mkfifo", "os.mknod"}
    list_events = {"os.listdir", "os.scandir", "glob.glob", "os.walk"}
    blocked_modules = {"ctypes", "_ctypes", "_posixsubprocess"}

    def inside(path, roots):
        if isinstance(path, int) or path is None:
            return True
        p = real(os.fsdecode(path))
        return p in roots or any(p.startswith(r.rstrip("/") + "/") for r in roots)

    def deny(what):
        raise PermissionError("weir-sandbox denied: " + what)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            writing = bool(flags & wflags) or any(c in (mode or "") for c in "wax+")
            if writing:
                if not inside(path, (work,)):
                    deny("write " + os.fsdecode(path))
            elif not (inside(path, reads) or real(os.fsdecode(path)) in devices):
                deny("read " + os.fsdecode(path))
        elif event in path_events:
            for p in args[:2] if event in ("os.rename", "os.link", "os.symlink") else args[:1]:
                if isinstance(p, (str, bytes, os.PathLike)) and not inside(p, (work,)):
                    deny(event + " " + os.fsdecode(p))
        elif event in list_events:
            if args and isinstance(args[0], (str, bytes, os.PathLike)) and not inside(args[0], reads):
                deny(event + " " + os.fsdecode(args[0]))
        elif event == "import":
            if args[0] in blocked_modules:
                deny("import " + args[0])
        elif event.startswith(denied):
            deny(event)

    sys.addaudithook(hook)
"""

_LAUNCHER = r"""
open(".weir_started", "w").close()
import json as _wj, os as _wo, sys as _ws
_WC = _wj.loads({config!r})
_WR = open(_WC["results"], "w", encoding="utf-8") if _WC["results"] else None
_WSRC = open(_WC["program"], encoding="utf-8").read()
_WTESTS = _WC["tests"]
_ws.argv = [_WC["program"], *_WC["args"]]
def _wrec(d):
    _WR.write(_wj.dumps(d) + "\n")
    _WR.flush()
{guard}
if _WC["guard"]:
    _weir_guard(_wo.getcwd())
_WNS = {{"__name__": "__main__", "__file__": _WC["program"], "__builtins__": __builtins__}}
def _wtraceback(e):
    import traceback as _wtb
    frames = [f for f in _wtb.extract_tb(e.__traceback__) if not f.filename.endswith(".weir_launch.py")]
    text = "".join(_wtb.format_list(frames)) + "".join(_wtb.format_exception_only(type(e), e))
    _ws.stderr.write("Traceback (most recent call last):\n" + text)
if _WTESTS is None:
    try:
        exec(compile(_WSRC, _WC["program"], "exec"), _WNS)
    except SystemExit:
        raise
    except BaseException as _we:
        _wtraceback(_we)
        _ws.stdout.flush()
        _wo._exit(1)
else:
    _WFAIL = 0
    try:
        exec(compile(_WSRC, _WC["program"], "exec"), _WNS)
    except BaseException as _we:
        _wrec({{"program_error": (type(_we).__name__ + ": " + str(_we))[:500]}})
        if isinstance(_we, SystemExit):
            raise
        _wtraceback(_we)
        _ws.stdout.flush()
        _wo._exit(1)
    for _wi, _wt in enumerate(_WTESTS):
        try:
            exec(compile(_wt, "<test %d>" % _wi, "exec"), _WNS)
        except BaseException as _we:
            _WFAIL += 1
            _wrec({{"test": _wi, "ok": False, "error": (type(_we).__name__ + ": " + str(_we))[:500]}})
        else:
            _wrec({{"test": _wi, "ok": True}})
    _WR.close()
    _ws.stdout.flush()
    _wo._exit(1 if _WFAIL else 0)
"""


class Python:
    """Python programs, run by the sandbox's interpreter in isolated mode (``-I -B``: no user site,
    no environment variables, no bytecode files)."""

    name = "python"
    program_file = "solution.py"

    def prepare(
        self,
        workdir: Path,
        program: str,
        *,
        tests: Sequence[str] | None,
        args: Sequence[str],
        guard: bool,
        iso: Isolation,
    ) -> tuple[list[str], str | None]:
        results = f".weir-results-{secrets.token_hex(8)}.jsonl" if tests is not None else None
        config = json.dumps(
            {
                "program": self.program_file,
                "results": results,
                "tests": list(tests) if tests is not None else None,
                "args": list(args),
                "guard": guard,
            }
        )
        (workdir / self.program_file).write_text(program, encoding="utf-8")
        launcher = _LAUNCHER.format(config=config, guard=_GUARD if guard else "")
        (workdir / ".weir_launch.py").write_text(launcher, encoding="utf-8")
        return [iso.python, "-I", "-B", ".weir_launch.py"], results


LANGUAGES: dict[str, Language] = {"python": Python()}


def get_language(name: str) -> Language:
    """The language called `name`; ValueError naming the known ones otherwise."""
    if name not in LANGUAGES:
        raise ValueError(f"sandbox: unknown language {name!r}; known: {sorted(LANGUAGES)}")
    return LANGUAGES[name]
