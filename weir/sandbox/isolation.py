"""Isolation levels: which OS mechanisms wrap a sandboxed program, detected at run time.

From strongest to weakest (docs/code.md says what each does and does not protect against):

- ``bwrap``: bubblewrap puts the program in new user, PID, network, IPC, UTS and cgroup namespaces
  with a file system of its own: /usr (and the interpreter's prefix) read-only, a read-only root
  and /dev, a private /proc, and the only writable places tmpfs mounts of `Limits.disk_mb` each
  (the work directory /sandbox, /tmp, /dev/shm); nothing else of the host exists for it.
- ``namespaces``: util-linux ``unshare``: new network (no interfaces but loopback: no network), PID
  (it cannot see or signal host processes; all its processes die with it), IPC, UTS and mount
  namespaces with its own /proc; the host file system stays visible, guarded only by file
  permissions (and, as root, the per-slot uid) and the Python guard.
- ``rlimit``: resource limits and a fresh work directory only, plus the Python guard (an in-process
  audit hook, which stops accidents and naive programs, not a determined attacker).

Every level applies the resource limits (`Limits`, via ``prlimit`` inside the level's namespaces),
a minimal environment, a new session, and, when weir runs as root, a uid of its own per execution,
leased machine-wide (so its leftover processes can be found and killed). The judge that runs an
execution's tests is not in the program's sandbox at all (`weir.sandbox.judge`), and runs as
`JUDGE_UID` when weir is root.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LEVELS", "Isolation", "detect", "wrap_command", "nproc_limit", "INNER_WORKDIR"]

log = logging.getLogger(__name__)

LEVELS = ("bwrap", "namespaces", "rlimit")
INNER_WORKDIR = "/sandbox"  # where bwrap mounts the work directory
SLOT_UID_BASE = 61000  # executions run as uids SLOT_UID_BASE .. + SLOT_UIDS - 1 when weir is root
SLOT_UIDS = 1000
JUDGE_UID = SLOT_UID_BASE - 1  # the judges' uid when weir is root (they run the rows' tests)


@dataclass(frozen=True)
class Isolation:
    """The level in force and how it is applied.

    `per_slot_uid`: each execution runs under a uid of its own (weir is root); `python`: the
    interpreter sandboxed Python programs run with; `prefix`: its installation prefix (bound
    read-only by bwrap); `unshare_user`: the namespaces level needs a user namespace (not root).
    """

    level: str
    per_slot_uid: bool
    python: str
    prefix: str
    unshare_user: bool = False

    def describe(self) -> str:
        uid = "a uid per execution" if self.per_slot_uid else "the caller's uid"
        return f"sandbox isolation: {self.level} ({uid}; python {self.python})"


def _world_traversable(path: str) -> bool:
    """Every directory above `path` is searchable by others and the file is executable by others,
    so a program running under an unprivileged slot uid can run it."""
    p = Path(path)
    try:
        if not p.stat().st_mode & 0o001:
            return False
        return all(d.stat().st_mode & 0o001 for d in p.parents)
    except OSError:
        return False


def _pick_python(requested: str | None, root: bool) -> str:
    if requested:
        found = shutil.which(requested)
        if not found:
            raise ValueError(f"sandbox.python={requested!r}: no such interpreter; give a path")
        return os.path.realpath(found)
    candidates = [os.path.realpath(sys.executable)]
    candidates += [p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)]
    if root:  # slot uids must be able to run it
        for c in candidates:
            if _world_traversable(c):
                return os.path.realpath(c)
    return candidates[0]


def _prefix(python: str) -> str:
    return str(Path(python).resolve().parent.parent)


def _probe(cmd: list[str], uid: int | None) -> bool:
    """Whether `cmd` (a level's wrapper around an empty Python run) succeeds. A run that times out
    or is killed by a signal (the OOM killer on a busy machine) is tried once more, with a longer
    timeout: a level the user asked for must not be refused for another job's load. A run that
    exits with an error is not: the level does not work here, and trying again only doubles the
    wait."""
    kwargs = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    for timeout in (20, 60):
        try:
            r = subprocess.run(
                cmd, capture_output=True, timeout=timeout, cwd=tempfile.gettempdir(), **kwargs
            )
        except subprocess.TimeoutExpired:
            continue
        except (OSError, subprocess.SubprocessError):
            return False
        if r.returncode >= 0:
            return r.returncode == 0
    return False


@functools.lru_cache(maxsize=8)
def detect(requested: str = "auto", python: str | None = None) -> Isolation:
    """The strongest level that works here (``auto``), or `requested`, checked by running it once.

    Raises ValueError when a requested level cannot run on this machine (with what to install or
    choose instead); ``auto`` never fails, it falls back to ``rlimit``.
    """
    if requested != "auto" and requested not in LEVELS:
        raise ValueError(f"sandbox.level={requested!r}: choose auto or one of {list(LEVELS)}")
    root = os.geteuid() == 0
    interp = _pick_python(python, root)
    per_slot_uid = root and _world_traversable(interp)
    uid = SLOT_UID_BASE if per_slot_uid else None
    prefix = _prefix(interp)
    order = LEVELS if requested == "auto" else (requested,)
    for level in order:
        iso = Isolation(level, per_slot_uid, interp, prefix, unshare_user=not root or per_slot_uid)
        if level == "rlimit" or _probe(
            wrap_command(iso, [interp, "-I", "-S", "-c", "pass"], disk_bytes=1 << 20), uid
        ):
            if requested == "auto":
                log.info(iso.describe())
            return iso
        if requested != "auto":
            hint = (
                "install bubblewrap (apt-get install bubblewrap) and allow user namespaces"
                if level == "bwrap"
                else "allow user namespaces (sysctl kernel.unprivileged_userns_clone=1)"
            )
            raise ValueError(
                f"sandbox.level={level} does not work on this machine: {hint}, or set "
                "sandbox.level=auto to use the strongest level available"
            )
    raise AssertionError("unreachable: rlimit always works")


def _root_dirs() -> list[str]:
    """bwrap arguments recreating /bin, /lib, /lib64, /sbin (symlinks into /usr on merged-/usr systems)."""
    args: list[str] = []
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return args


def wrap_command(
    iso: Isolation,
    argv: list[str],
    *,
    disk_bytes: int = 64 << 20,
    files: dict[str, int] | None = None,
) -> list[str]:
    """`argv` wrapped in the isolation level's launcher.

    Under bwrap the program's writable places are tmpfs mounts of `disk_bytes` each (the work
    directory at /sandbox, /tmp and /dev/shm) and everything else is read-only, the root and /dev
    included; `files` (name -> a readable fd) are copied into /sandbox. Its first process is the
    program itself (``--as-pid-1``), which bwrap waits for, so its exit status and CPU time reach
    weir. The other levels run in the caller's work directory (the caller writes the files)."""
    if iso.level == "bwrap":
        size = str(disk_bytes)
        bwrap = shutil.which("bwrap") or "bwrap"
        cmd = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1"]
        cmd += ["--ro-bind", "/usr", "/usr", *_root_dirs()]
        if not iso.prefix.startswith("/usr"):
            cmd += ["--ro-bind", iso.prefix, iso.prefix]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
        cmd += ["--remount-ro", "/dev", "--size", size, "--tmpfs", "/tmp"]
        cmd += ["--size", size, "--tmpfs", INNER_WORKDIR]
        for name, fd in (files or {}).items():
            cmd += ["--file", str(fd), f"{INNER_WORKDIR}/{name}"]
        cmd += ["--chdir", INNER_WORKDIR, "--remount-ro", "/"]
        if os.geteuid() == 0 and not iso.per_slot_uid:
            cmd += ["--cap-drop", "ALL"]
        return [*cmd, "--", *argv]
    if iso.level == "namespaces":
        cmd = [shutil.which("unshare") or "unshare"]
        if iso.unshare_user:
            cmd += ["--user", "--map-current-user"]
        cmd += ["--net", "--pid", "--fork", "--kill-child", "--ipc", "--uts", "--mount"]
        cmd += ["--mount-proc"]
        return [*cmd, "--", *argv]
    return list(argv)


def nproc_limit(iso: Isolation, processes: int) -> int:
    """RLIMIT_NPROC that lets the program have `processes` processes and threads at once (its own
    main process included), set inside the level's namespaces. The kernel counts a uid's tasks per
    user namespace: in bwrap's (the program is its first process) and under a leased uid the count
    is the program's alone; unshare's own process sits in the new user namespace too."""
    return processes + (1 if iso.level == "namespaces" and iso.unshare_user else 0)
