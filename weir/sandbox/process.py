"""Run one execution: the program under its isolation level and limits, and its judge beside it.

weir is the supervisor. It starts the program (wrapped by the level, limits set by ``prlimit``
inside the level's namespaces) with three pipes besides stdin, stdout and stderr: the start pipe,
on which the launcher says it started before any program code runs, and, with tests, the request
and reply pipes to the judge, which the judge server (`weir.sandbox.judge_server`) forks outside
the sandbox and which gets the tests from a config pipe and writes its verdicts to a report pipe:
pipes only weir and the judge hold. weir feeds the inputs, reads every output up to its cap, kills
everything at the wall-clock limit, and reaps the program with ``wait4`` (the CPU time and peak
memory of its tree; for a tree it had to kill, the CPU time its processes had used just before).
Nothing the program writes to a file is ever read: what weir reports comes from pipes, exit
statuses and /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from weir.sandbox.isolation import Isolation, nproc_limit, wrap_command
from weir.sandbox.judge_server import JudgeServer
from weir.sandbox.languages import HELLO
from weir.sandbox.limits import Limits
from weir.sandbox.uids import kill_uid, tree_cpu, user_process_count

__all__ = ["RawResult", "JudgeJob", "run_process", "limit_prefix", "judge_limits"]

_MB = 1 << 20
_READ = 1 << 16
_JUDGE_OUTPUT = 4 << 20
_LINGER_S = 1.0  # how long the program may outlive a judge that has finished


@dataclass
class JudgeJob:
    """The judge's part of an execution: its config (tests, prefix, entry points, limits, import
    path) and the server that forks it."""

    config: dict[str, Any]
    server: JudgeServer


@dataclass
class RawResult:
    """What the supervisor saw. `killed_for` is set when it killed the tree itself (``timeout``,
    ``output_limit``, or ``lingered``: still running after the judge had finished); `started` is
    whether the launcher's hello came through the start pipe; `judge` holds the judge's report
    lines."""

    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    wall_s: float
    cpu_s: float
    max_rss_mb: float
    killed_for: str | None = None
    start_error: str | None = None
    started: bool = False
    judge: list[dict[str, Any]] = field(default_factory=list)


def limit_prefix(limits: Limits, nproc: int, python: str) -> list[str]:
    """``prlimit`` arguments setting `limits`, or where prlimit is absent a `python` re-exec that
    sets the same limits."""
    cpu = max(1, int(limits.cpu_s + 0.999))
    values = {
        "as": limits.memory_mb * _MB,
        "cpu": (cpu, cpu + 1),
        "nproc": nproc,
        "nofile": limits.open_files,
        "fsize": limits.file_bytes,
        "core": 0,
    }
    prlimit = shutil.which("prlimit")
    if prlimit:
        args = [prlimit]
        for k, v in values.items():
            args.append(f"--{k}={v[0]}:{v[1]}" if isinstance(v, tuple) else f"--{k}={v}")
        return [*args, "--"]
    sets = "".join(
        f"r.setrlimit(r.RLIMIT_{k.upper()},{v if isinstance(v, tuple) else (v, v)});"
        for k, v in values.items()
    )
    code = f"import resource as r,os,sys;{sets}os.execvp(sys.argv[1],sys.argv[1:])"
    return [python, "-I", "-S", "-c", code]


def judge_limits(limits: Limits) -> dict[str, Any]:
    """The judge's own limits: the program's CPU and file limits, memory at least 512 MB."""
    cpu = max(1, int(limits.cpu_s + 0.999))
    return {
        "cpu": [cpu, cpu + 1],
        "as": max(limits.memory_mb, 512) * _MB,
        "nofile": limits.open_files,
        "fsize": limits.file_bytes,
        "core": 0,
    }


class _Fds:
    """The fds weir opened for one execution, closed when it ends (or as soon as a child has its
    copy)."""

    def __init__(self) -> None:
        self.open: list[int] = []

    def pipe(self) -> tuple[int, int]:
        r, w = os.pipe()
        self.open += [r, w]
        return r, w

    def add(self, fd: int) -> int:
        self.open.append(fd)
        return fd

    def close(self, *fds: int) -> None:
        for fd in fds:
            if fd in self.open:
                self.open.remove(fd)
                os.close(fd)

    def close_all(self) -> None:
        self.close(*list(self.open))


def run_process(
    argv: list[str],
    *,
    iso: Isolation,
    limits: Limits,
    workdir: str | None,
    files: dict[str, bytes],
    stdin: bytes = b"",
    uid: int | None = None,
    env: dict[str, str] | None = None,
    judge: JudgeJob | None = None,
) -> RawResult:
    """Run the program `argv` (the three pipe fds are appended) inside `iso` under `limits`, as
    `uid` when given, with `files` in its work directory (`workdir` for the levels without a file
    system of their own) and its judge beside it when given; reap everything."""
    fds = _Fds()
    try:
        return _run(argv, iso, limits, workdir, files, stdin, uid, env, judge, fds)
    finally:
        fds.close_all()


def _place_files(
    iso: Isolation, workdir: str | None, files: dict[str, bytes], uid: int | None, fds: _Fds
) -> dict[str, int]:
    """Write `files` into the work directory; under bwrap into memfds it copies into its tmpfs."""
    if iso.level == "bwrap":
        out = {}
        for name, data in files.items():
            fd = fds.add(os.memfd_create(name, os.MFD_CLOEXEC))
            os.write(fd, data)
            os.lseek(fd, 0, os.SEEK_SET)
            out[name] = fd
        return out
    assert workdir is not None
    for name, data in files.items():
        path = os.path.join(workdir, name)
        with open(path, "xb") as f:
            f.write(data)
        if uid is not None:
            os.chown(path, uid, uid)
    return {}


def _run(
    argv: list[str],
    iso: Isolation,
    limits: Limits,
    workdir: str | None,
    files: dict[str, bytes],
    stdin: bytes,
    uid: int | None,
    env: dict[str, str] | None,
    judge: JudgeJob | None,
    fds: _Fds,
) -> RawResult:
    ctl_r, ctl_w = fds.pipe()
    req_r = resp_w = -1
    jpipes: dict[str, int] = {}
    job = None
    if judge is not None:  # the judge first: if it cannot start, the program never does
        cfg_r, cfg_w = fds.pipe()
        report_r, report_w = fds.pipe()
        req_r, req_w = fds.pipe()
        resp_r, resp_w = fds.pipe()
        job = judge.server.submit([cfg_r, report_w, req_w, resp_r])
        fds.close(cfg_r, report_w, req_w, resp_r)
        jpipes = {"cfg": cfg_w, "report": report_r}
    file_fds = _place_files(iso, workdir, files, uid, fds)
    nproc = nproc_limit(iso, limits.processes)
    if uid is None and iso.level == "rlimit":  # RLIMIT_NPROC counts all of weir's user's tasks
        nproc += user_process_count()
    program = [*argv, str(ctl_w), str(req_r), str(resp_w)]
    cmd = wrap_command(
        iso,
        limit_prefix(limits, nproc, iso.python) + program,
        disk_bytes=limits.disk_mb * _MB,
        files=file_fds,
    )
    ids = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    start = time.monotonic()
    try:
        popen = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir or "/",
            env=env if env is not None else {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
            close_fds=True,
            pass_fds=(ctl_w, *[fd for fd in (req_r, resp_w) if fd >= 0], *file_fds.values()),
            **ids,
        )
    except OSError as e:
        if job is not None and judge is not None:
            judge.server.kill(job)
        return RawResult(
            None, None, b"", b"", 0.0, 0.0, 0.0, start_error=f"{type(e).__name__}: {e}"
        )
    fds.close(ctl_w, req_r, resp_w, *file_fds.values())
    try:
        pidfd: int | None = fds.add(os.pidfd_open(popen.pid))
    except (AttributeError, OSError):
        pidfd = None
    seen: dict[str, Any] = {}
    reaped = None
    cpu = 0.0
    try:
        config = json.dumps(judge.config, ensure_ascii=True).encode() if judge else b""
        deadline = start + limits.wall_s
        seen = _supervise(popen, pidfd, stdin, ctl_r, jpipes, config, limits, deadline, fds)
        reaped = seen.get("reaped")
        if reaped is None:
            cpu = tree_cpu(popen.pid, uid)
    finally:
        if job is not None and judge is not None and not seen.get("judge_done"):
            judge.server.kill(job)
        _kill_tree(popen.pid, uid)
        if reaped is None:
            _, status, usage = os.wait4(popen.pid, 0)
            reaped = (status, usage)
        popen.returncode = 0  # reaped here: keep Popen from waiting on a gone pid
        _kill_tree(popen.pid, uid)  # whatever the program left behind
        for stream in (popen.stdin, popen.stdout, popen.stderr):
            if stream is not None and not stream.closed:
                stream.close()
    wall = time.monotonic() - start
    status, usage = reaped
    code = os.waitstatus_to_exitcode(status)
    return RawResult(
        exit_code=code if code >= 0 else None,
        signal=-code if code < 0 else None,
        stdout=bytes(seen["out"][: limits.output_bytes]),
        stderr=bytes(seen["err"][: limits.output_bytes]),
        wall_s=wall,
        cpu_s=max(cpu, usage.ru_utime + usage.ru_stime),
        max_rss_mb=usage.ru_maxrss / 1024,
        killed_for=seen["killed_for"],
        started=bytes(seen["ctl"]) == HELLO,
        judge=_report_lines(seen["report"]),
    )


def _kill_tree(pid: int, uid: int | None) -> None:
    """SIGKILL the program's session (its tree, at the rlimit level too) and, under a leased uid,
    everything left under it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if uid is not None:
        kill_uid(uid)


def _report_lines(data: bytearray) -> list[dict[str, Any]]:
    lines = []
    for line in bytes(data).splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict):
            lines.append(d)
    return lines


def _write_some(
    sel: selectors.BaseSelector, key: Any, writes: dict[int, memoryview], fds: _Fds
) -> None:
    """Write what the pipe takes of the pending data; close it once all is written (or its reader
    is gone)."""
    try:
        n = os.write(key.fd, writes[key.fd][:_READ])
    except BlockingIOError:
        n = 0
    except BrokenPipeError:
        n = len(writes[key.fd])
    writes[key.fd] = writes[key.fd][n:]
    if not writes[key.fd]:
        del writes[key.fd]
        sel.unregister(key.fileobj)
        _close_input(key.fileobj, fds)


def _close_input(target: Any, fds: _Fds) -> None:
    """Close an input pipe: a Popen stream, or an fd of the execution's own."""
    if isinstance(target, int):
        fds.close(target)
    else:
        target.close()


def _supervise(
    popen: subprocess.Popen,
    pidfd: int | None,
    stdin: bytes,
    ctl_r: int,
    jpipes: dict[str, int],
    config: bytes,
    limits: Limits,
    deadline: float,
    fds: _Fds,
) -> dict[str, Any]:
    """Feed the program's stdin and the judge's config, collect every output, reap the program;
    stop at the deadline, at an output over its cap, once the program has exited and its pipes
    are drained and the judge is done, or when the program outlives a finished judge. Returns
    what was seen (``reaped``: the program's wait status and rusage, if it was reaped)."""
    seen: dict[str, Any] = {k: bytearray() for k in ("out", "err", "ctl", "report")} | {
        "killed_for": None,
        "reaped": None,
        "judge_done": not jpipes,
    }
    assert popen.stdin and popen.stdout and popen.stderr
    sel = selectors.DefaultSelector()
    writes: dict[int, memoryview] = {}
    inputs: dict[int, Any] = {}
    for target, data in ((popen.stdin, stdin), (jpipes.get("cfg"), config)):
        if target is None:
            continue
        fd = target if isinstance(target, int) else target.fileno()
        if data:
            os.set_blocking(fd, False)
            writes[fd], inputs[fd] = memoryview(data), target
            sel.register(target, selectors.EVENT_WRITE)
        else:
            _close_input(target, fds)
    caps = {"out": limits.output_bytes + 1, "err": limits.output_bytes + 1, "ctl": 64}
    sel.register(popen.stdout, selectors.EVENT_READ, "out")
    sel.register(popen.stderr, selectors.EVENT_READ, "err")
    sel.register(ctl_r, selectors.EVENT_READ, "ctl")
    if "report" in jpipes:
        sel.register(jpipes["report"], selectors.EVENT_READ, "report")
        caps["report"] = _JUDGE_OUTPUT
    if pidfd is not None:
        sel.register(pidfd, selectors.EVENT_READ, "exit")
    poll = 0.5 if pidfd is not None else 0.01
    judged_at = exited_at = None
    try:
        while True:
            if seen["reaped"] is None:
                pid, status, usage = os.wait4(popen.pid, os.WNOHANG)
                if pid:
                    seen["reaped"] = (status, usage)
            reading = {k.data for k in sel.get_map().values() if k.data in caps}
            seen["judge_done"] = "report" not in reading
            if seen["reaped"] is not None and not reading:
                break
            now = time.monotonic()
            if now >= deadline:
                seen["killed_for"] = "timeout"
                break
            if jpipes and seen["judge_done"] and seen["reaped"] is None:
                judged_at = judged_at or now  # the verdicts are in: the program's part is over
                if now - judged_at > _LINGER_S:
                    seen["killed_for"] = "lingered"
                    break
            if seen["reaped"] is not None and reading <= {"out", "err", "ctl"}:
                exited_at = exited_at or now  # pipes held open by a process it left behind
                if now - exited_at > 0.2:
                    break
            for key, _ in sel.select(min(deadline - now, poll)):
                if key.data == "exit":
                    sel.unregister(key.fileobj)
                elif key.fd in writes:
                    _write_some(sel, key, writes, fds)
                else:
                    chunk = os.read(key.fd, _READ)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buf = seen[key.data]
                    buf.extend(chunk[: max(0, caps[key.data] - len(buf))])
                    if key.data in ("out", "err") and len(buf) > limits.output_bytes:
                        seen["killed_for"] = "output_limit"
                        return seen
    finally:
        sel.close()
        for fd in writes:  # inputs their readers never took to the end
            _close_input(inputs[fd], fds)
    return seen
