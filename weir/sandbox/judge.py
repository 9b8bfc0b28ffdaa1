"""The judge: runs a row's tests in a process of its own and calls the program across a pipe.

The program under test runs sandboxed and serves calls: after its top level has run it reports the
names it defines, then answers each request (a function name and arguments) with the result, an
exception's type and message, or "cannot cross" for a value that is not plain data. The judge runs
each test snippet (``assert f(2) == 4``, HumanEval's ``check(candidate)``) in its own namespace,
where the program's functions are proxies that send their arguments over the request pipe and
build the reply with `weir.sandbox.wire` (plain builtin values only): comparisons, ``assert`` and
every builtin a test uses are the judge's own. The tests are never in the program's file system
or memory: the judge reads them from a config pipe only weir holds, and writes its verdicts to a
report pipe the program cannot reach. Judges are forked by a judge server (`serve`, weir's end in
`weir.sandbox.judge_server`), one per execution.

The namespace of the tests starts with the row's ``prefix`` (trusted code from the data set:
HumanEval's prompt, with its imports and helpers), run in the judge. The ``entry_points`` become
proxies; without entry points every function the program defines does. Other names of the program
are added where the prefix does not define them (its plain-data globals as values).

A test passes when it raises nothing and no call in it failed at the boundary (the program died,
answered with something that is not plain data, or broke the protocol): such a failure raises
`ProgramFailure`, a BaseException a test's ``except Exception`` cannot swallow, and counts even if
the test catches it. Once the program is gone, the remaining tests fail as not reached.

This file is stdlib-only: weir runs it with the sandbox's interpreter (``python -I -S -c``, with
the interpreter's import path from weir), after `weir.sandbox.wire` (see `weir.sandbox.boot`).
"""

import builtins
import os
import sys

if __name__ != "__weir_judge__":  # in the judge process `wire` is defined before this runs
    from weir.sandbox import wire


class ProgramFailure(BaseException):
    """A call that failed at the process boundary (never the program's own exception)."""


class ProgramError(Exception):
    """An exception the program raised whose type is not a builtin exception of the judge."""


def _exception(name, message):
    """The exception to raise in the judge for one the program raised: the builtin exception type
    of that name where there is one, else `ProgramError`."""
    cls = getattr(builtins, name, None) if type(name) is str else None
    text = message if type(message) is str else ""
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(text)
        except Exception:
            pass
    return ProgramError(f"{name}: {text}")


class Link:
    """The judge's end of the pipes to the program: one request, then one reply line (at most
    `cap` bytes), in turn."""

    def __init__(self, req_fd, resp_fd, cap):
        self.req_fd = req_fd
        self.resp = os.fdopen(resp_fd, "rb")
        self.cap = cap
        self.gone = None  # why the program can no longer be called
        self.fault = None  # the first boundary failure in the current test

    def receive(self):
        """The next message from the program (a dict); ProgramFailure if it has none to give."""
        if self.gone:
            raise ProgramFailure(self.gone)
        try:
            line = self.resp.readline(self.cap + 1)
        except OSError as e:
            line, self.gone = b"", f"the program's reply pipe failed ({e})"
        if not line:
            self.gone = self.gone or "the program ended"
            raise ProgramFailure(self.gone)
        if len(line) > self.cap or not line.endswith(b"\n"):
            self.gone = f"a reply over {self.cap} bytes"
            raise ProgramFailure(self.gone)
        try:
            msg = wire.json_loads(line)
        except (ValueError, RecursionError):
            msg = None
        if type(msg) is not dict or len(msg) != 1:
            self.gone = "a reply that is not in the protocol"
            raise ProgramFailure(self.gone)
        return msg

    def call(self, name, args, kwargs):
        try:
            request = wire.json_dumps(
                {"call": name, "args": wire.to_wire(list(args)), "kwargs": wire.to_wire(kwargs)}
            )
        except wire.Unencodable as e:
            raise TypeError(f"an argument of {name}() cannot be sent to the program: {e}") from None
        try:
            if self.gone:
                raise ProgramFailure(self.gone)
            _write_all(self.req_fd, request.encode() + b"\n")
            msg = self.receive()
        except ProgramFailure as e:
            self._fail(str(e))
        except OSError as e:
            self.gone = f"the program stopped reading ({e.strerror})"
            self._fail(self.gone)
        ((kind, body),) = msg.items()
        if kind == "r":
            try:
                return wire.from_wire(body)
            except (ValueError, RecursionError) as e:
                self._fail(f"{name}() returned something that is not plain data ({e})")
        if kind == "e" and type(body) is list and len(body) == 2:
            raise _exception(body[0], str(body[1])[:1000])
        if kind == "x":
            self._fail(
                f"{name}() returned a value that cannot leave the program: {str(body)[:200]}"
            )
        self.gone = "a reply that is not in the protocol"
        self._fail(self.gone)

    def _fail(self, why):
        self.fault = self.fault or why
        raise ProgramFailure(why)

    def close(self):
        try:  # noqa: SIM105  (no contextlib: the judge imports as little as it can)
            os.close(self.req_fd)
        except OSError:
            pass


class Candidate:
    """A function of the program, as the tests see it: calling it calls the program."""

    def __init__(self, link, name):
        self._link = link
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        return self._link.call(self.__name__, args, kwargs)

    def __repr__(self):
        return f"<function {self.__name__} of the program under test>"


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


_REPORT = [1]  # the fd verdicts go to
_RUNNING = [None]  # the index of the test being run


def _on_cpu_limit(signum, frame):
    """RLIMIT_CPU's soft limit reached (SIGXCPU): the running test used the judge's CPU time; it is
    reported as the test that hit the limit, then the judge ends (the rest are not reached)."""
    _report({"limit": "cpu_time", "test": _RUNNING[0]})
    if _RUNNING[0] is not None:
        _report({"test": _RUNNING[0], "ok": False, "error": "CPU time limit exceeded"})
    os._exit(4)


def _report(obj):
    _write_all(_REPORT[0], (wire.json_dumps(obj) + "\n").encode())


def _limit(cfg):
    import resource

    for name, value in cfg.items():
        soft, hard = value if type(value) is list else (value, value)
        resource.setrlimit(getattr(resource, "RLIMIT_" + name.upper()), (soft, hard))


def _bind(ns, link, ready, entry_points):
    """Put the program's names into the tests' namespace (see the module docstring)."""
    body = ready.get("ready")
    body = body if type(body) is dict else {}
    names, values = body.get("names"), body.get("values")
    callables = [n for n in names if type(n) is str] if type(names) is list else []
    try:
        plain = wire.from_wire(values) if values is not None else {}
    except (ValueError, RecursionError):
        plain = {}
    plain = {k: v for k, v in plain.items() if type(k) is str} if type(plain) is dict else {}
    if entry_points:
        for name in entry_points:
            ns[name] = Candidate(link, name)
        for name in callables:
            ns.setdefault(name, Candidate(link, name))
        for name, value in plain.items():
            ns.setdefault(name, value)
    else:
        for name, value in plain.items():
            ns[name] = value
        for name in callables:
            ns[name] = Candidate(link, name)


def judge(cfg, link):
    """Run the tests of `cfg` against the program behind `link`, reporting each verdict."""
    tests = cfg["tests"]
    ns = {"__name__": "__main__", "__builtins__": builtins}
    if cfg.get("prefix"):
        try:
            exec(compile(cfg["prefix"], "<prefix>", "exec"), ns)
        except BaseException as e:  # a prefix that is not code on its own: tests get what ran
            _report({"note": f"the prefix did not run in the judge: {type(e).__name__}: {e}"[:300]})
    try:
        ready = link.receive()
    except ProgramFailure as e:
        ready = {"program_error": f"{e} before the tests"}
    if "program_error" in ready:
        why = str(ready["program_error"])[:500]
        _report({"program_error": why})
        for i in range(len(tests)):
            _report({"test": i, "ok": False, "error": f"not reached ({why})"})
        return
    _bind(ns, link, ready, cfg.get("entry_points"))
    for i, test in enumerate(tests):
        if link.gone:
            _report({"test": i, "ok": False, "error": f"not reached ({link.gone})"})
            continue
        link.fault = None
        _RUNNING[0] = i
        try:
            exec(compile(test, f"<test {i}>", "exec"), ns)
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
        else:
            error = None
        if link.fault is not None:
            error = f"ProgramFailure: {link.fault}"
        _report({"test": i, "ok": error is None, "error": None if error is None else error[:500]})


def run_job(cfg_fd, report_fd, req_fd, resp_fd):
    """One judge: the config (JSON) from `cfg_fd`, verdicts to `report_fd`, the program behind
    `req_fd` / `resp_fd`. Never returns."""
    _REPORT[0] = report_fd
    _report({"up": 1})
    try:
        with os.fdopen(cfg_fd, "rb") as f:
            cfg = wire.json_loads(f.read())
        import signal

        signal.signal(signal.SIGXCPU, _on_cpu_limit)
        _limit(cfg.get("limits", {}))
        if cfg.get("path"):
            sys.path[:] = cfg["path"]
        link = Link(req_fd, resp_fd, int(cfg["reply_bytes"]))
        judge(cfg, link)
        link.close()
        _report({"done": 1})
    except BaseException as e:
        try:
            import traceback

            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            _report({"judge_error": text[-2000:]})
        finally:
            os._exit(3)
    os._exit(0)


def serve(sock_fd):
    """The judge server: one message per job on the unix socket `sock_fd` (``{"job": id}`` with
    the job's four fds, see `run_job`), answered by forking a judge for it; ``{"kill": id}`` kills
    that judge. It forks from a clean interpreter that has loaded the judge once, so a judge costs
    a fork, not an interpreter's start-up. Ends when weir closes the socket."""
    import signal
    import socket

    sock = socket.socket(fileno=sock_fd)
    children = {}

    def reap(*_):
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                return
            for job, child in list(children.items()):
                if child == pid:
                    del children[job]

    signal.signal(signal.SIGCHLD, reap)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1024, 4)
        except OSError:
            break
        if not msg:
            break
        try:
            req = wire.json_loads(msg)
        except ValueError:
            req = {}
        if "kill" in req:
            if req["kill"] in children:
                _sigkill(children[req["kill"]])
        elif "job" in req and len(fds) == 4:
            try:
                pid = os.fork()
            except OSError:
                pid = -1  # closing the fds below tells weir the judge never started
            if pid == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sock.close()
                run_job(*fds)
            if pid > 0:
                children[req["job"]] = pid
        for fd in fds:
            os.close(fd)
    for pid in list(children.values()):
        _sigkill(pid)
    os._exit(0)


def _sigkill(pid):
    try:  # noqa: SIM105  (no contextlib: the judge imports as little as it can)
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def server_command(python, sock_fd):
    """The command that runs the judge server under `python` on the socket `sock_fd` (isolated
    mode, no ``site``: each judge gets the interpreter's import path in its config)."""
    from weir.sandbox.boot import boot_program, source_of

    main = ("<weir-judge>", source_of("judge") + "\nserve(int(sys.argv[1]))\n")
    program = boot_program(python, main, "__weir_judge__")
    return [python, "-I", "-S", "-B", "-c", program, str(sock_fd)]
