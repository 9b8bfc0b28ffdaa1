"""Engine servers (vLLM, SGLang) placed by Ray: one actor per replica owns its server process.

On Ray every server replica is a `ServerHost` actor in one of the engines' placement-group bundles.
It starts ``<engine.python> -m ...`` on the node Ray chose, bound to that node's address, with the
GPUs Ray gave the actor (the child inherits ``CUDA_VISIBLE_DEVICES``; vLLM's
``--tensor-parallel-size`` / SGLang's ``--tp-size`` is the bundle's GPU count), and answers the
driver's questions about the process: is it alive, restart it, stop it, its pid.

The driver talks to the server itself over HTTP (`weir.engine.server_engine.ServerEngine`), exactly
as to a local server: streamed requests, pause / resume, weight updates and restart-and-continue are
one code path whatever the placement. `RemoteProcess` is the driver's stand-in for the process: it
has the methods of `ServerProcess` that the engine uses, each a call to the host actor.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from weir.engine.servers import ServerProcess, free_port

MakeProcess = Callable[[int, int, str], ServerProcess]
"""`(replica index, port, host) -> ServerProcess` (not started): how one server is launched."""


def node_address() -> str:
    """This node's address as the other nodes reach it (Ray's view of it; 127.0.0.1 outside Ray)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


class ServerHost:
    """A Ray actor owning one engine server process on its node (see the module docstring).

    Args:
        make_process: builds the (not yet started) `ServerProcess` for a port and host; a
            picklable callable (e.g. `weir.engine.vllm_engine.VllmLauncher`).
        index: the replica's index (its server's seed and log file).

    Create it with ``max_concurrency`` > 1 so that `stop` can interrupt a `start` that waits for
    the server's health check.
    """

    def __init__(self, make_process: MakeProcess, index: int) -> None:
        self.make_process, self.index = make_process, index
        self.host = node_address()
        self.proc: ServerProcess | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        # the server dies with the thread that started it (`die_with_parent`): one thread that
        # lives as long as this actor starts every server
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="weir-server-spawner")

    def check(self) -> None:
        """Raise `EngineNotInstalled` unless the engine imports in `engine.python` on this node."""
        check = getattr(self.make_process, "check", None)
        if check is not None:
            check()

    def start(self) -> str:
        """Start the server (a port free on this node) and wait until it serves; its base URL."""
        with self._lock:
            self._stopping.clear()
            if self.proc is None:
                self.proc = self.make_process(self.index, free_port(self.host), self.host)
                self.proc.die_with_parent = True
            if not self.proc.alive():
                self._spawner.submit(self.proc.start).result()
            proc = self.proc
        proc.wait_ready(self._stopping.is_set)
        return proc.url

    def url(self) -> str | None:
        return self.proc.url if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def restart(self) -> str:
        """Stop the server if it still runs, start it again (same port) and wait until it serves."""
        with self._lock:
            self._stopping.clear()
            if self.proc is not None:
                self.proc.stop()
        return self.start()

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            if self.proc is not None:
                self.proc.stop()

    def pid(self) -> int | None:
        """The server's process id (e.g. for a test that kills it)."""
        return self.proc.pid if self.proc is not None else None

    def node(self) -> tuple[str, int]:
        """(node address, this actor's pid)."""
        return self.host, os.getpid()


@dataclass(eq=False)
class RemoteProcess:
    """The driver's handle on a server that a `ServerHost` actor owns: `ServerProcess`'s methods
    as the engine uses them, each a call to the actor. `url` follows the actor (an actor that Ray
    restarted on another node serves elsewhere)."""

    actor: Any
    url: str
    starts: int = 1
    call_timeout_s: float = 30.0

    def alive(self) -> bool:
        import ray

        try:
            return bool(ray.get(self.actor.alive.remote(), timeout=self.call_timeout_s))
        except Exception:  # the actor itself is gone (or restarting): the server with it
            return False

    def healthy(self) -> bool:
        from weir.engine.servers import http_ok

        return self.alive() and http_ok(self.url + "/health")

    @property
    def pid(self) -> int | None:
        import ray

        return ray.get(self.actor.pid.remote(), timeout=self.call_timeout_s)

    def start(self) -> None:
        import ray

        self.url = ray.get(self.actor.start.remote())

    def wait_ready(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        self.start()

    def restart(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Start the server again and wait until it serves (an actor that Ray restarted starts a
        new one). Returns once it serves, or raises `EngineStartError` with its log's last lines."""
        import ray

        self.url = ray.get(self.actor.restart.remote())
        self.starts += 1

    def stop(self, grace_s: float = 10.0) -> None:
        import ray

        with contextlib.suppress(Exception):  # already gone
            ray.get(self.actor.stop.remote(), timeout=grace_s + 20)


def ray_placement(options: Callable[[int], dict[str, Any]]) -> Callable[[MakeProcess, int], list]:
    """A placement (`weir.engine.remote.Placement`) of server replicas as `ServerHost` actors:
    replica i with Ray actor options ``options(i)`` (its placement-group bundle, GPUs), all started
    in parallel; if one does not come up, every one is stopped and the error is its log's tail."""

    def place(launcher: MakeProcess, count: int) -> list:
        import ray

        from weir.engine.servers import Replica

        host = ray.remote(ServerHost)
        actors = [
            host.options(**options(i), max_concurrency=4).remote(launcher, i) for i in range(count)
        ]
        try:
            ray.get([a.check.remote() for a in actors])
            refs = [a.start.remote() for a in actors]
            urls = [_started(a, ref) for a, ref in zip(actors, refs, strict=True)]
        except BaseException:
            for a in actors:
                RemoteProcess(a, "").stop()
                ray.kill(a)
            raise
        return [Replica(url, RemoteProcess(a, url)) for a, url in zip(actors, urls, strict=True)]

    return place


def _started(actor: Any, ref: Any, attempts: int = 3) -> str:
    """The URL `actor.start` returned; if Ray restarted the actor meanwhile (its process died,
    e.g. under memory pressure, and `max_restarts` allows it), start it again."""
    import ray

    for _ in range(attempts):
        try:
            return ray.get(ref)
        except ray.exceptions.ActorUnavailableError:
            ref = actor.start.remote()
    return ray.get(ref)
