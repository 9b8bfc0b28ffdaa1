"""The processes of an execution, found from /proc: by uid, by descent, their CPU time; uid leases.

When weir runs as root each execution runs under a uid of its own, leased machine-wide
(`lease_uid`), so everything it started can be found (`processes_of_uid`) and killed (`kill_uid`)
afterwards. `tree_cpu` adds up the CPU time of an execution's processes before they are killed
(a killed process's time never reaches the parent's ``wait4``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import time
from collections.abc import Iterator

from weir.sandbox.isolation import SLOT_UID_BASE, SLOT_UIDS

__all__ = ["processes_of_uid", "kill_uid", "lease_uid", "tree_cpu", "user_process_count"]

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def processes_of_uid(uid: int | range) -> list[int]:
    """Pids of the live (not zombie) processes of `uid` (or of any uid in a range), from /proc."""
    uids = range(uid, uid + 1) if isinstance(uid, int) else uid
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid not in uids:  # owned by the effective uid
                continue
        except OSError:
            continue
        fields = _stat(entry)
        if fields is not None and fields[0] not in ("Z", "X"):
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
    st = os.lstat(_LOCK_DIR)
    if st.st_uid != os.getuid() or not os.path.isdir(_LOCK_DIR) or os.path.islink(_LOCK_DIR):
        raise RuntimeError(f"{_LOCK_DIR} is not a directory of weir's own user; remove it")
    start = random.randrange(SLOT_UIDS)
    for i in range(SLOT_UIDS):
        uid = SLOT_UID_BASE + (start + i) % SLOT_UIDS
        fd = os.open(
            os.path.join(_LOCK_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600
        )
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


def user_process_count() -> int:
    """Live processes of weir's own uid (RLIMIT_NPROC counts them all where no uid is leased)."""
    return len(processes_of_uid(os.getuid()))


def tree_cpu(pid: int, uid: int | None) -> float:
    """CPU seconds (user + system) of an execution's processes as they stand: every process of
    `uid` when the execution has a uid of its own, else `pid` and its descendants. Each process
    counts its own time and that of the children it has reaped (which are gone from /proc), so
    nothing is counted twice; zombies still hold their time."""
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        if uid is not None:
            try:
                if os.stat(f"/proc/{entry}").st_uid != uid:
                    continue
            except OSError:
                continue
        fields = _stat(entry)
        if fields is not None:
            stats[int(entry)] = fields
    if uid is None:
        children: dict[int, list[int]] = {}
        for p, fields in stats.items():
            children.setdefault(int(fields[1]), []).append(p)
        tree, todo = set(), [pid]
        while todo:
            p = todo.pop()
            if p in stats and p not in tree:
                tree.add(p)
                todo += children.get(p, [])
        stats = {p: stats[p] for p in tree}
    ticks = sum(sum(int(x) for x in fields[11:15]) for fields in stats.values())
    return ticks / _TICK
