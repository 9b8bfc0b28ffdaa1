"""Run one execution: the program under its isolation level and limits, and the judge beside it.

weir is the supervisor. It starts the program (wrapped by the level, limits set by ``prlimit``
inside the level's namespaces) with three pipes besides stdin/stdout/stderr: the start pipe, on
which the launcher says it started before any program code runs, and, with tests, the request and
reply pipes to the judge, a second process outside the sandbox (`weir.sandbox.judge`) that gets the
tests on its stdin and writes its verdicts to its stdout, pipes only weir holds. weir feeds stdin,
reads every output up to its cap, kills everything at the wall-clock limit, and reaps what it
started with ``wait4`` (the CPU time and peak memory of the program's tree; for a tree it had to
kill, the CPU time its processes had used just before). Nothing the program writes to a file is
ever read: what weir reports comes from pipes, exit statuses and /proc.
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
from weir.sandbox.judge import judge_command
from weir.sandbox.languages import HELLO
from weir.sandbox.limits import Limits
from weir.sandbox.uids import kill_uid, tree_cpu, user_process_count

__all__ = ["RawResult", "JudgeJob", "run_process", "limit_prefix"]

_MB = 1 << 20
_READ = 1 << 16
_JUDGE_OUTPUT = 4 << 20
_LINGER_S = 1.0  # how long the program may outlive a judge that has finished


@dataclass
class JudgeJob:
    """The judge's part of an execution: its config (tests, prefix, entry points, limits) and the
    uid it runs under (None: weir's own)."""

    config: dict[str, Any]
    uid: int | None


@dataclass
class RawResult:
    """What the supervisor saw. `killed_for` is set when it killed the tree itself (``timeout``,
    ``output_limit``, or ``lingered``: still running after the judge had finished); `started` is
    whether the launcher's hello came through the start pipe; `judge` holds the judge's report
    lines, `judge_exit` its exit status (None if it never ran or was killed)."""

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
    judge_exit: int | None = None
    judge_stderr: bytes = b""


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


class _Proc:
    """One started process and what weir collects from it."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.status: int | None = None
        self.usage: Any = None
        try:
            self.pidfd: int | None = os.pidfd_open(popen.pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def reap(self, block: bool = False) -> bool:
        if self.status is None:
            pid, status, usage = os.wait4(self.pid, 0 if block else os.WNOHANG)
            if pid:
                self.status, self.usage = status, usage
                self.popen.returncode = 0  # reaped here: keep Popen from waiting on a gone pid
        return self.status is not None

    def close(self) -> None:
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


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
    system of their own), and the judge beside it when given; reap everything."""
    own: list[int] = []  # fds weir closes when done
    try:
        return _run(argv, iso, limits, workdir, files, stdin, uid, env, judge, own)
    finally:
        for fd in own:
            with contextlib.suppress(OSError):
                os.close(fd)


def _pipe(own: list[int]) -> tuple[int, int]:
    r, w = os.pipe()
    own += [r, w]
    return r, w


def _close(fd: int, own: list[int]) -> None:
    os.close(fd)
    own.remove(fd)


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
    own: list[int],
) -> RawResult:
    ctl_r, ctl_w = _pipe(own)
    req_r = req_w = resp_r = resp_w = -1
    if judge is not None:
        req_r, req_w = _pipe(own)
        resp_r, resp_w = _pipe(own)
    file_fds: dict[str, int] = {}
    if iso.level == "bwrap":  # copied into its tmpfs work directory by bwrap
        for name, data in files.items():
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            own.append(fd)
            os.write(fd, data)
            os.lseek(fd, 0, os.SEEK_SET)
            file_fds[name] = fd
    else:
        assert workdir is not None
        for name, data in files.items():
            path = os.path.join(workdir, name)
            with open(path, "wb") as f:
                f.write(data)
            if uid is not None:
                os.chown(path, uid, uid)
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
        cand = _Proc(
            subprocess.Popen(
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
        )
    except OSError as e:
        return RawResult(
            None, None, b"", b"", 0.0, 0.0, 0.0, start_error=f"{type(e).__name__}: {e}"
        )
    for fd in (ctl_w, req_r, resp_w, *file_fds.values()):
        if fd >= 0:
            _close(fd, own)
    procs = [cand]
    jproc = None
    if judge is not None:
        jids = {"user": judge.uid, "group": judge.uid, "extra_groups": []} if judge.uid else {}
        try:
            jproc = _Proc(
                subprocess.Popen(
                    judge_command(iso.python, req_w, resp_r),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd="/",
                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=(req_w, resp_r),
                    **jids,
                )
            )
        except OSError as e:
            _kill([cand], uid)
            cand.close()
            return RawResult(
                None,
                None,
                b"",
                b"",
                0.0,
                0.0,
                0.0,
                start_error=f"the judge: {type(e).__name__}: {e}",
            )
        _close(req_w, own)
        _close(resp_r, own)
        procs.append(jproc)
    try:
        seen = _supervise(cand, jproc, judge, stdin, ctl_r, limits, start + limits.wall_s)
        cpu = None
        if not all(p.status is not None for p in procs):
            if cand.status is None:
                cpu = tree_cpu(cand.pid, uid)
            _kill(procs, uid)
            for p in procs:
                p.reap(block=True)
        wall = time.monotonic() - start
        _kill(procs, uid)  # whatever the program left behind
    finally:
        for p in procs:
            if p.status is None:
                _kill([p], uid)
                p.reap(block=True)
            p.close()
    code = os.waitstatus_to_exitcode(cand.status)
    usage = cand.usage
    jcode = os.waitstatus_to_exitcode(jproc.status) if jproc is not None else None
    return RawResult(
        exit_code=code if code >= 0 else None,
        signal=-code if code < 0 else None,
        stdout=bytes(seen["out"][: limits.output_bytes]),
        stderr=bytes(seen["err"][: limits.output_bytes]),
        wall_s=wall,
        cpu_s=max(cpu or 0.0, usage.ru_utime + usage.ru_stime),
        max_rss_mb=usage.ru_maxrss / 1024,
        killed_for=seen["killed_for"],
        started=bytes(seen["ctl"]) == HELLO,
        judge=_report_lines(seen["judge"]),
        judge_exit=None if jcode is None or seen["judge_killed"] else jcode,
        judge_stderr=bytes(seen["judge_err"][-4000:]),
    )


def _kill(procs: list[_Proc], uid: int | None) -> None:
    """SIGKILL each process's group (its session: the program's tree, at the rlimit level too) and,
    under a leased uid, everything left under it."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
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


def _write_some(sel: selectors.BaseSelector, key: Any, writes: dict[int, memoryview]) -> None:
    """Write what the pipe takes of the pending data; close it when all is written (or the reader
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
        key.fileobj.close()


def _supervise(
    cand: _Proc,
    jproc: _Proc | None,
    judge: JudgeJob | None,
    stdin: bytes,
    ctl_r: int,
    limits: Limits,
    deadline: float,
) -> dict[str, Any]:
    """Feed the stdins, collect every output, reap exits; stop at the deadline, at an output over
    its cap, or once everything has exited and its pipes are drained. Returns what was seen."""
    seen: dict[str, Any] = {
        "out": bytearray(),
        "err": bytearray(),
        "ctl": bytearray(),
        "judge": bytearray(),
        "judge_err": bytearray(),
        "killed_for": None,
        "judge_killed": False,
    }
    cp = cand.popen
    assert cp.stdin and cp.stdout and cp.stderr
    sel = selectors.DefaultSelector()
    writes: dict[int, memoryview] = {}

    def feed(stream: Any, data: bytes) -> None:
        if data:
            os.set_blocking(stream.fileno(), False)
            writes[stream.fileno()] = memoryview(data)
            sel.register(stream, selectors.EVENT_WRITE)
        else:
            stream.close()

    feed(cp.stdin, stdin)
    caps = {"out": limits.output_bytes + 1, "err": limits.output_bytes + 1, "ctl": 64}
    sel.register(cp.stdout, selectors.EVENT_READ, "out")
    sel.register(cp.stderr, selectors.EVENT_READ, "err")
    sel.register(ctl_r, selectors.EVENT_READ, "ctl")
    procs = [cand]
    if jproc is not None and judge is not None:
        jp = jproc.popen
        assert jp.stdin and jp.stdout and jp.stderr
        feed(jp.stdin, json.dumps(judge.config, ensure_ascii=True).encode())
        sel.register(jp.stdout, selectors.EVENT_READ, "judge")
        sel.register(jp.stderr, selectors.EVENT_READ, "judge_err")
        caps.update(judge=_JUDGE_OUTPUT, judge_err=_JUDGE_OUTPUT)
        procs.append(jproc)
    for p in procs:
        if p.pidfd is not None:
            sel.register(p.pidfd, selectors.EVENT_READ, p)
    poll = 0.5 if all(p.pidfd is not None for p in procs) else 0.01
    judged_at = exited_at = None
    try:
        while True:
            for p in procs:
                p.reap()
            reading = any(isinstance(k.data, str) for k in sel.get_map().values())
            exited = all(p.status is not None for p in procs)
            if exited and not reading:
                break
            now = time.monotonic()
            if now >= deadline:
                seen["killed_for"] = "timeout"
                break
            if jproc is not None and jproc.status is not None and cand.status is None:
                judged_at = judged_at or now  # the verdicts are in: the program's part is over
                if now - judged_at > _LINGER_S:
                    seen["killed_for"] = "lingered"
                    break
            if exited:  # a pipe is held open by a process the program left behind
                exited_at = exited_at or now
                if now - exited_at > 0.2:
                    break
            for key, _ in sel.select(min(deadline - now, poll)):
                if isinstance(key.data, _Proc):
                    sel.unregister(key.fileobj)
                elif key.fd in writes:
                    _write_some(sel, key, writes)
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
        if jproc is not None and jproc.status is None:
            seen["judge_killed"] = True
    return seen
