"""weir's end of the judge server: one long-lived process per sandbox that forks a judge per job.

The server (`weir.sandbox.judge.serve`) runs the sandbox's interpreter outside the program's
sandbox, as the judges' own uid when weir is root, and forks each judge from its clean interpreter:
a judge then costs a fork rather than an interpreter's start-up (which would double the CPU cost of
an execution). A job is one message on a unix socket carrying four fds: the config pipe, the report
pipe, and the request and reply pipes to the program. The server is started on first use and again
if it has died; it exits when weir closes its socket.
"""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import threading
import weakref

from weir.sandbox.judge import server_command

__all__ = ["JudgeServer"]


class JudgeServer:
    """Starts judges for `python`'s programs, as `uid` (None: weir's own)."""

    def __init__(self, python: str, uid: int | None) -> None:
        self.python = python
        self.uid = uid
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._sock: socket.socket | None = None
        self._popen: subprocess.Popen | None = None
        self._finalizer = weakref.finalize(self, _stop, {})

    def submit(self, fds: list[int]) -> int:
        """Start a judge on `fds` (config, report, request, reply); returns its job id.
        RuntimeError when no server can be started."""
        with self._lock:
            job = next(self._ids)
            msg = json.dumps({"job": job}).encode()
            for _ in range(2):
                if self._sock is None or self._popen is None or self._popen.poll() is not None:
                    self._restart()
                assert self._sock is not None
                try:
                    socket.send_fds(self._sock, [msg], fds)
                    return job
                except OSError:
                    self._stop_locked()
            raise RuntimeError(f"the judge server ({self.python}) could not be started")

    def kill(self, job: int) -> None:
        """SIGKILL the judge of `job` if it is still running."""
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.send(json.dumps({"kill": job}).encode())
                except OSError:
                    self._stop_locked()

    def close(self) -> None:
        with self._lock:
            self._stop_locked()

    def _restart(self) -> None:
        self._stop_locked()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ids = {"user": self.uid, "group": self.uid, "extra_groups": []} if self.uid else {}
        try:
            self._popen = subprocess.Popen(
                server_command(self.python, theirs.fileno()),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd="/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,
                close_fds=True,
                pass_fds=(theirs.fileno(),),
                **ids,
            )
        except OSError as e:
            mine.close()
            raise RuntimeError(f"the judge server could not be started: {e}") from e
        finally:
            theirs.close()
        self._sock = mine
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, {"sock": mine, "popen": self._popen})

    def _stop_locked(self) -> None:
        _stop({"sock": self._sock, "popen": self._popen})
        self._sock = self._popen = None


def _stop(parts: dict) -> None:
    sock, popen = parts.get("sock"), parts.get("popen")
    if sock is not None:
        sock.close()  # the server sees the socket close, kills its judges and exits
    if popen is not None:
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
