"""One run per run directory: an exclusive lock held for the life of the run.

Two runs on one directory (the same command started again in another terminal) would both write
checkpoints and metrics there, and one dies when the other renames a checkpoint under it. So
`Run.open` takes an exclusive ``flock`` on ``<run dir>/.weir.lock`` before it reads or writes
anything there, and `Run.close` lets it go; a second run is refused with one line naming the directory
and the process that holds it. On Ray the driver holds it (the loop runs in the driver).

The kernel releases a ``flock`` when the process that holds it dies, however it dies (SIGKILL, OOM
kill, power cut on a local disk): a killed run leaves a lock file but no lock, and the same command
resumes. The descriptor is not inherited by the processes a run starts (Python's default), so an
engine server that outlives its run does not keep the directory locked.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are not locked there
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "RunDirInUse", "RunLock"]

LOCK_NAME = ".weir.lock"


class RunDirInUse(RuntimeError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """The exclusive lock on a run directory; `release` (or process exit) frees it."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Lock `run_dir` (created if missing) for this process, or raise `RunDirInUse` naming the
        process that holds it. The lock file holds the holder's pid and host."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        if fcntl is None:
            return cls(path, None)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "a process"
            os.close(fd)
            raise RunDirInUse(
                f"run directory {run_dir} is in use by another run ({holder}); wait for it to "
                "finish or stop it, or set run.dir to another directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Let the lock go (the file stays: removing it would race a run that just opened it)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
