"""Run one command under an isolation level and `Limits`: capped output, wall clock, rusage, cleanup.

The caller owns the work directory; this module starts the process tree, feeds stdin, reads stdout
and stderr up to the cap, kills the whole tree at the wall-clock limit, reaps it with ``wait4``
(CPU time and peak memory of the tree) and leaves no process behind: the session's process group is
killed, and under a uid of its own every process left under that uid is killed too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from weir.sandbox.isolation import (
    SLOT_UID_BASE,
    SLOT_UIDS,
    WRAPPER_PROCESSES,
    Isolation,
    wrap_command,
)
from weir.sandbox.limits import Limits

__all__ = ["RawResult", "run_process", "kill_uid", "processes_of_uid", "lease_uid"]

_MB = 1 << 20
_READ = 1 << 16


@dataclass
class RawResult:
    """What `run_process` saw; `killed_for` is set when the sandbox killed the tree itself."""

    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    wall_s: float
    cpu_s: float
    max_rss_mb: float
    killed_for: str | None = None
    start_error: str | None = None


def _limit_prefix(limits: Limits, processes: int) -> list[str]:
    """``prlimit`` arguments, or a Python re-exec that sets the same limits where prlimit is absent."""
    cpu = max(1, int(limits.cpu_s + 0.999))
    values = {
        "as": limits.memory_mb * _MB,
        "cpu": (cpu, cpu + 1),
        "nproc": processes,
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
    names = {"as": "AS", "cpu": "CPU", "nproc": "NPROC", "nofile": "NOFILE", "fsize": "FSIZE"}
    sets = "".join(
        f"r.setrlimit(r.RLIMIT_{names[k]},{v if isinstance(v, tuple) else (v, v)});"
        for k, v in values.items()
        if k in names
    )
    code = f"import resource as r,os,sys;{sets}r.setrlimit(r.RLIMIT_CORE,(0,0));os.execvp(sys.argv[1],sys.argv[1:])"
    return [sys.executable, "-I", "-S", "-c", code]


def processes_of_uid(uid: int | range) -> list[int]:
    """Pids of the live (not zombie) processes of `uid` (or of any uid in a range), from /proc."""
    uids = range(uid, uid + 1) if isinstance(uid, int) else uid
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}")
            if st.st_uid not in uids:  # /proc/<pid> is owned by the process's effective uid
                continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def kill_uid(uid: int, timeout_s: float = 5.0) -> int:
    """SIGKILL every process of `uid` until none is left (a fork bomb keeps forking for a moment);
    returns how many were killed."""
    killed, deadline = 0, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = processes_of_uid(uid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    return killed


_LOCK_DIR = "/run/lock/weir-sandbox" if os.path.isdir("/run/lock") else "/tmp/weir-sandbox-locks"


@contextlib.contextmanager
def lease_uid() -> Iterator[int]:
    """A uid no other execution uses right now, in any process on the machine: an exclusive
    ``flock`` on its lock file (root-only directory) held for the execution, released even if weir
    dies. Before it is handed out, anything still running under it is killed."""
    os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
    start = random.randrange(SLOT_UIDS)
    for i in range(SLOT_UIDS):
        uid = SLOT_UID_BASE + (start + i) % SLOT_UIDS
        fd = os.open(os.path.join(_LOCK_DIR, str(uid)), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            kill_uid(uid)
            yield uid
        finally:
            os.close(fd)  # releases the lock
        return
    raise RuntimeError(f"all {SLOT_UIDS} sandbox uids are in use")


def _user_process_count() -> int:
    return len(processes_of_uid(os.getuid()))


def run_process(
    argv: list[str],
    *,
    iso: Isolation,
    limits: Limits,
    workdir: str,
    stdin: bytes = b"",
    uid: int | None = None,
    env: dict[str, str] | None = None,
) -> RawResult:
    """Run `argv` inside `iso` under `limits` in `workdir` (as `uid` when given) and reap it."""
    processes = limits.processes + WRAPPER_PROCESSES[iso.level]
    if uid is None:  # RLIMIT_NPROC counts every process of the uid: leave room for the caller's own
        processes += _user_process_count()
    cmd = _limit_prefix(limits, processes) + wrap_command(iso, argv, workdir)
    ids = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=env if env is not None else {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
            close_fds=True,
            **ids,
        )
    except OSError as e:
        return RawResult(
            None, None, b"", b"", 0.0, 0.0, 0.0, start_error=f"{type(e).__name__}: {e}"
        )
    out, err, killed_for = bytearray(), bytearray(), None
    deadline = start + limits.wall_s
    reaped = None
    try:
        killed_for = _pump(proc, stdin, out, err, limits, deadline)
        while killed_for is None:  # pipes closed: wait for the exit within the deadline
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                reaped = (status, usage)
                break
            if time.monotonic() >= deadline:
                killed_for = "timeout"
                break
            time.sleep(0.002)
    finally:
        if reaped is None:
            _kill_tree(proc.pid)
            _, status, usage = os.wait4(proc.pid, 0)
            reaped = (status, usage)
        proc.returncode = 0  # reaped here; keep Popen from waiting on a pid that is gone
        wall = time.monotonic() - start
        _kill_tree(proc.pid)
        if uid is not None:
            kill_uid(uid)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None and not stream.closed:
                stream.close()
    status, usage = reaped
    code = os.waitstatus_to_exitcode(status)
    return RawResult(
        exit_code=code if code >= 0 else None,
        signal=-code if code < 0 else None,
        stdout=bytes(out[: limits.output_bytes]),
        stderr=bytes(err[: limits.output_bytes]),
        wall_s=wall,
        cpu_s=usage.ru_utime + usage.ru_stime,
        max_rss_mb=usage.ru_maxrss / 1024,
        killed_for=killed_for,
    )


def _kill_tree(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _pump(
    proc: subprocess.Popen,
    stdin: bytes,
    out: bytearray,
    err: bytearray,
    limits: Limits,
    deadline: float,
) -> str | None:
    """Feed stdin, collect output until both pipes close; the reason if the tree must be killed."""
    sel = selectors.DefaultSelector()
    assert proc.stdin and proc.stdout and proc.stderr
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    try:
        while any(k.events & selectors.EVENT_READ for k in sel.get_map().values()):
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            for key, _ in sel.select(min(left, 0.5)):
                if key.fileobj is proc.stdin:
                    try:
                        n = os.write(proc.stdin.fileno(), pending[:_READ])
                    except BlockingIOError:
                        n = 0
                    except BrokenPipeError:
                        n = len(pending)
                    pending = pending[n:]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fileobj.fileno(), _READ)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(key.data) > limits.output_bytes:
                    return "output_limit"
    finally:
        sel.close()
    return None
