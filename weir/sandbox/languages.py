"""Languages the sandbox runs: how a program becomes files and a command, and how it serves calls.

A `Language` turns a program into files for the work directory and the command that runs it
(`Prepared`). The command gets three more arguments, file descriptors: the start pipe, on which
its first act is to write ``weir-started`` (what tells weir the program started: anything after
is the program's own doing), then the request and reply pipes of the judge (``-1`` when the
execution has no tests). With tests, the program runs its top level, reports the names it defines
and serves the judge's calls, one JSON line each way, with values in `weir.sandbox.wire`'s tagged
encoding (see `weir.sandbox.judge`): the tests themselves never enter its process. Python is built
in; another language is one more class with the same members, registered in `LANGUAGES`.

With ``guard`` the Python launcher first installs an audit hook (PEP 578) that denies opening files
outside the work directory and the interpreter's own installation, writing outside the work
directory, sockets, new processes, signals to other processes and ctypes. The hook runs in the
program's own interpreter: it stops accidents and naive hostile code, not a determined attacker;
the OS levels do that.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from weir.sandbox.boot import boot_program
from weir.sandbox.isolation import Isolation

__all__ = ["Language", "Prepared", "Python", "LANGUAGES", "get_language", "DENIED_MARK", "HELLO"]

DENIED_MARK = "weir-sandbox denied:"
HELLO = b"weir-started\n"  # the launcher's first write on the start pipe, before any program code


@dataclass
class Prepared:
    """A program ready to run: the command (the three pipe fds are appended) and the files to put
    in its work directory (name -> bytes)."""

    argv: list[str]
    files: dict[str, bytes]


class Language(Protocol):
    """How to run programs of one language."""

    name: str

    def prepare(
        self,
        program: str,
        *,
        serve: bool,
        args: Sequence[str],
        guard: bool,
        iso: Isolation,
        reply_bytes: int,
    ) -> Prepared:
        """The command and files; with `serve` the program serves the judge's calls."""
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
import os as _wo, sys as _ws
_wo.write(int(_ws.argv[2]), b"weir-started\n")
_wo.close(int(_ws.argv[2]))
_WREQ, _WRESP = int(_ws.argv[3]), int(_ws.argv[4])
_WC = wire.json_loads(_ws.argv[1])
import _signal as _wsig  # (the signal module would import enum)

# the CPU limit's SIGXCPU ends the program with 128 + 24 even where it is a PID namespace's first
# process, which ignores signals it has no handler for (it would run on to the hard limit)
_wsig.signal(24, lambda *_: _wo._exit(152))
_ws.argv = [_WC["program"], *_WC["args"]]
if _WC["guard"]:
    _weir_guard(_wo.getcwd())
_WNS = {"__name__": "__main__", "__file__": _WC["program"], "__builtins__": __builtins__}
_WHIDE = ("<weir-launcher>", "<weir-wire>", "<string>")


def _wtraceback(e):
    import traceback as _wtb

    frames = [f for f in _wtb.extract_tb(e.__traceback__) if f.filename not in _WHIDE]
    text = "".join(_wtb.format_list(frames)) + "".join(_wtb.format_exception_only(type(e), e))
    _ws.stderr.write("Traceback (most recent call last):\n" + text)


def _wdie(e):
    _wtraceback(e)
    _ws.stdout.flush()
    _wo._exit(1)


def _wtext(e):
    try:
        return str(e)[:1000]
    except BaseException:
        return "(unprintable)"


def _wsend(obj):
    line = wire.json_dumps(obj).encode() + b"\n"
    if len(line) > _WC["reply_bytes"]:
        line = b'{"x":"a reply over %d bytes"}\n' % _WC["reply_bytes"]
    view = memoryview(line)
    while view:
        view = view[_wo.write(_WRESP, view) :]


def _wready():
    names, values, budget = [], [], _WC["reply_bytes"] // 2
    for k, v in list(_WNS.items()):
        if k.startswith("__") or type(v) is type(_ws):
            continue
        if callable(v):
            names.append(k)
            continue
        try:
            enc = wire.to_wire(v)
            size = len(wire.json_dumps(enc))
        except Exception:
            continue
        if size <= budget:
            values.append([k, enc])
            budget -= size
    return {"ready": {"names": names, "values": {"$d": values}}}


def _wserve():
    requests = _wo.fdopen(_WREQ, "rb")
    while True:
        line = requests.readline()
        if not line:
            return
        try:
            msg = wire.json_loads(line)
            fn = _WNS.get(msg["call"])
            if fn is None:
                raise NameError("name %r is not defined" % msg["call"])
            result = fn(*wire.from_wire(msg["args"]), **wire.from_wire(msg["kwargs"]))
        except BaseException as e:
            reply = {"e": [type(e).__name__, _wtext(e)]}
        else:
            try:
                reply = {"r": wire.to_wire(result)}
            except BaseException as e:
                reply = {"x": _wtext(e)}
        result = None
        _wsend(reply)


def _wsource(data):
    # the program's text as Python reads a source file: UTF-8 (strictly) unless it declares
    # another encoding (PEP 263)
    if b"coding" in b"\n".join(data.split(b"\n", 2)[:2]):
        return data  # compile() honours the declaration
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SyntaxError(f"Non-UTF-8 code in the program ({e})") from None


try:
    with open(_WC["program"], "rb") as _wf:
        _WCODE = compile(_wsource(_wf.read()), _WC["program"], "exec")
    exec(_WCODE, _WNS)
except SystemExit as _we:
    if _WREQ >= 0:
        _wsend({"program_error": ("SystemExit: " + _wtext(_we))[:500]})
    raise
except BaseException as _we:
    if _WREQ >= 0:
        _wsend({"program_error": (type(_we).__name__ + ": " + _wtext(_we))[:500]})
    _wdie(_we)
if _WREQ >= 0:
    _wsend(_wready())
    _wserve()
    _ws.stdout.flush()
    _ws.stderr.flush()
    _wo._exit(0)
"""


class Python:
    """Python programs, run by the sandbox's interpreter in isolated mode (``-I -B``: no user site,
    no environment variables, no bytecode files). The launcher reaches the interpreter as a ``-c``
    program (`weir.sandbox.boot`), the program as ``solution.py`` in its work directory."""

    name = "python"
    program_file = "solution.py"

    def prepare(
        self,
        program: str,
        *,
        serve: bool,
        args: Sequence[str],
        guard: bool,
        iso: Isolation,
        reply_bytes: int,
    ) -> Prepared:
        config = json.dumps(
            {
                "program": self.program_file,
                "args": list(args),
                "guard": guard,
                "reply_bytes": reply_bytes,
            },
            ensure_ascii=True,
        )
        boot = boot_program(
            iso.python, ("<weir-launcher>", _GUARD + _LAUNCHER), "__weir_launcher__"
        )
        try:  # text decoded with surrogateescape: its own bytes back
            data = program.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            data = program.encode("utf-8", "surrogatepass")
        files = {self.program_file: data}
        return Prepared([iso.python, "-I", "-B", "-c", boot, config], files)


LANGUAGES: dict[str, Language] = {"python": Python()}


def get_language(name: str) -> Language:
    """The language called `name`; ValueError naming the known ones otherwise."""
    if name not in LANGUAGES:
        raise ValueError(f"sandbox: unknown language {name!r}; known: {sorted(LANGUAGES)}")
    return LANGUAGES[name]
