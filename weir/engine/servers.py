"""Engine servers as processes: start one from a Python environment of its own, health-check it,
restart it when it dies, or attach to one already running at a URL.

vLLM and SGLang pin their own torch and transformers, so weir never imports them: each server is
``<python> -m <module> ...`` of whatever environment ``engine.python`` names (by default the
``.venv-vllm`` that ``make setup-vllm`` builds), writing its output to a log file that an error
quotes when the server does not come up.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

LOG_TAIL_LINES = 25
_STARTED: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


def _stop_all() -> None:
    """At exit: servers run in sessions of their own, so they would outlive weir otherwise."""
    for proc in list(_STARTED):
        with contextlib.suppress(Exception):
            proc.stop(grace_s=3.0)


atexit.register(_stop_all)


class EngineNotInstalled(ValueError):
    """The engine's package does not import in the Python environment meant to run it."""


class EngineStartError(ValueError):
    """A server process exited or did not answer its health check in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def log_tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file, or a note that there is none."""
    if path is None or not Path(path).exists():
        return "(no log)"
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(empty log)"


_IMPORTS_OK: set[tuple[str, str]] = set()
"""(python, module) pairs that imported: each is probed once per process (importing vLLM takes
15-20 s on a small CPU, and a session may start many servers from the same environment)."""


def check_installed(python: str, module: str, install_hint: str) -> None:
    """Raise `EngineNotInstalled` naming `install_hint` unless `python -c 'import module'` works
    (a success is remembered for the process; a failure is probed again, after a fix)."""
    if (python, module) in _IMPORTS_OK:
        return
    if not Path(python).exists() and not _on_path(python):
        raise EngineNotInstalled(
            f"engine.python: {python} does not exist; {install_hint} (or point engine.python at a "
            f"Python that has {module} installed)"
        )
    probe = subprocess.run(
        [python, "-W", "ignore", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise EngineNotInstalled(
            f"{module} does not import in {python} ({last}); install it with: {install_hint}"
        )
    _IMPORTS_OK.add((python, module))


def _on_path(cmd: str) -> bool:
    import shutil

    return shutil.which(cmd) is not None


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET `url` answers 2xx within `timeout_s`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (local server URL)
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass(eq=False)
class ServerProcess:
    """One engine server that weir starts, watches and restarts.

    Args:
        argv: the full command (the Python executable first).
        url: its base URL (``http://host:port``).
        health_path: GET path that answers 200 once the server serves requests.
        log_path: where stdout and stderr go (appended across restarts).
        env: extra environment variables.
        startup_timeout_s: how long `wait_ready` waits.
        die_with_parent: the server gets SIGTERM when the thread that started it ends (Linux's
            parent-death signal): a server a Ray actor started must not outlive the actor, which
            Ray may kill without running any of its code.
    """

    argv: Sequence[str]
    url: str
    health_path: str = "/health"
    log_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 300.0
    die_with_parent: bool = False
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Launch the process (in a session of its own, so that stop() ends its children too)."""
        if self.log_path is not None:
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                list(self.argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
                preexec_fn=_term_with_parent if self.die_with_parent else None,  # noqa: PLW1509
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        self.starts += 1
        _STARTED.add(self)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        return self.alive() and http_ok(self.url + self.health_path)

    def wait_ready(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Block until the health check passes; `EngineStartError` with the log's last lines if the
        process exits first or `startup_timeout_s` passes."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline and not should_stop():
            if not self.alive():
                code = self.proc.returncode if self.proc is not None else None
                raise EngineStartError(
                    f"engine server `{' '.join(self.argv[:3])} ...` exited with code {code} "
                    f"before it served; last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if http_ok(self.url + self.health_path):
                return
            time.sleep(0.5)
        self.stop()
        if should_stop():
            raise EngineStartError(f"stopped waiting for the engine server at {self.url}")
        raise EngineStartError(
            f"engine server at {self.url} did not answer {self.health_path} within "
            f"{self.startup_timeout_s:.0f} s (engine.startup_timeout_s); last lines of "
            f"{self.log_path}:\n{log_tail(self.log_path)}"
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`. A stopped server
        (SIGSTOP, a debugger) is continued after the SIGTERM so that it can act on it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
            os.killpg(self.proc.pid, signal.SIGCONT)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def restart(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Stop (if still running), start again and wait until it serves."""
        self.stop()
        self.start()
        self.wait_ready(should_stop)


def _term_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent thread ends (prctl PR_SET_PDEATHSIG)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


@dataclass
class Replica:
    """One engine server behind weir's router: a process weir owns, or a URL it attached to."""

    url: str
    process: ServerProcess | None = None

    @property
    def owned(self) -> bool:
        return self.process is not None

    def wait_ready(
        self, timeout_s: float = 300.0, should_stop: Callable[[], bool] = lambda: False
    ) -> None:
        if self.process is not None:
            self.process.wait_ready(should_stop)
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not should_stop():
            if http_ok(self.url + "/health"):
                return
            time.sleep(0.5)
        if should_stop():
            raise EngineStartError(f"stopped waiting for the engine server at {self.url}")
        raise EngineStartError(
            f"engine server at {self.url} (engine.urls) did not answer /health within {timeout_s:.0f} s"
        )


def default_python(venv: str = ".venv-vllm") -> str:
    """``engine.python`` when unset: ``$WEIR_VLLM_PYTHON`` (e.g. a GPU machine's own Python with vLLM
    installed, as scripts/gpu_check.sh sets it), else `venv` in the current directory, else in
    weir's checkout (an editable install, where `make setup-vllm` builds it), else this interpreter."""
    if os.environ.get("WEIR_VLLM_PYTHON"):
        return os.environ["WEIR_VLLM_PYTHON"]
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = root / venv / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return sys.executable


def model_max_len(model_path: str | Path, requested: int | None) -> int:
    """The servers' context limit: `requested`, else the model's ``max_position_embeddings``.

    A limit above the model's is refused here (vLLM refuses it too, after a slow start)."""
    import json

    cfg_file = Path(model_path) / "config.json"
    own = None
    if cfg_file.exists():
        cfg = json.loads(cfg_file.read_text())
        own = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get(
            "max_position_embeddings"
        )
    if requested is None:
        if own is None:
            raise ValueError(
                f"engine.max_model_len: {model_path} names no max_position_embeddings; set it"
            )
        return int(own)
    if own is not None and requested > own:
        raise ValueError(
            f"engine.max_model_len={requested} is above the model's max_position_embeddings "
            f"({own}); set engine.max_model_len <= {own}"
        )
    return int(requested)
