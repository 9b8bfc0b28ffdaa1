"""A server engine's replicas failing and coming back.

Part of `weir.engine.server_engine.ServerEngine` (a mixin: the methods use the engine's state). A
replica found dead (a request to it failed and its health check does too, or the watcher saw the
process weir started exit) is marked down and restarted in the background, once; requests go to the
other replicas meanwhile. Once it serves again it gets the current weights (and sleeps if the engine
does) before it takes requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

__all__ = ["Recovery", "WeightsNotReady"]

log = logging.getLogger("weir.engine.server_engine")


class WeightsNotReady(RuntimeError):
    """A restarted server cannot be given the current weights now (the trainer moved on since the
    last push): it waits, out of the routing, and the next weight update includes it."""


class Recovery:
    """The failure-and-recovery half of `ServerEngine` (see the module docstring)."""

    def _alive(self, i: int) -> bool:
        proc = self.replicas[i].process
        return proc is None or proc.alive()

    async def _watch(self, period_s: float) -> None:
        """Every `period_s`, restart the servers weir started whose process has exited, so that a
        server that dies while no request is on it is back before one needs it."""
        while not self._closed:
            await asyncio.sleep(period_s)
            for i, replica in enumerate(self.replicas):
                if self._closed:
                    return
                idle = self.healthy[i] and i not in self._recovering
                if replica.owned and idle and not await asyncio.to_thread(self._alive, i):
                    await self._lost(i)

    async def _serves(self, i: int) -> bool:
        """Whether replica `i`'s process (if weir started it) lives and it answers /health."""
        from weir.engine.servers import http_ok

        return await asyncio.to_thread(self._alive, i) and await asyncio.to_thread(
            http_ok, self.replicas[i].url + "/health"
        )

    async def _survivors(self, targets: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """Of `targets` ((index, replica) pairs a weight update is about to go to), those whose
        process lives (a server weir did not start counts as alive); the others are marked down
        and restarted (no longer awaiting weights), with a warning. Only the process: a /health
        that a loaded machine answers late would restart a server that serves."""
        alive = [await asyncio.to_thread(self._alive, i) for i, _ in targets]
        for (i, replica), ok in zip(targets, alive, strict=True):
            if not ok:
                log.warning(
                    "%s server %s exited before a weight update; it restarts and gets the "
                    "weights when it is back",
                    self.backend.name,
                    replica.url,
                )
                self.awaiting.discard(i)
                await self._lost(i)
        return [t for t, ok in zip(targets, alive, strict=True) if ok]

    async def _shed(
        self, targets: list[tuple[int, Any]], wedged: frozenset[str]
    ) -> list[tuple[int, Any]]:
        """After a failed weight update to `targets`: those that no longer serve (`_serves`), and
        those left waiting in an aborted broadcast (`wedged` URLs), are marked down and recovered
        (`_recover`: restarted where weir started them; a wedged server weir did not start is
        given the weights once it answers again); returns the others."""
        left = []
        for i, replica in targets:
            stuck = replica.url in wedged
            if stuck or not await self._serves(i):
                self.awaiting.discard(i)
                await self._lost(i, force=True)  # decided here: not asked again
            else:
                left.append((i, replica))
        return left

    async def _lost(self, i: int, *, force: bool = False) -> None:
        """Mark replica `i` down and restart it in the background (once); with `force` even if it
        still answers (a server that serves but cannot take weights again without a restart)."""
        if not self.healthy[i] and i in self._recovering:
            return
        if not force and await self._serves(i):
            return  # a transient error: the server still serves
        self.healthy[i] = False
        if i not in self._recovering:
            self._recovering[i] = asyncio.create_task(self._recover(i))

    async def _stop_recovery(self) -> None:
        tasks = list(self._recovering.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _recover(self, i: int) -> None:
        replica = self.replicas[i]
        try:
            if self._closed:  # the engine is shutting down: a restart would outlive it
                return
            if replica.process is not None and self.restart:
                log.warning("%s server %s died; restarting it", self.backend.name, replica.url)
                await asyncio.to_thread(replica.process.restart, lambda: self._closed)
                replica.url = replica.process.url  # a server a Ray actor restarted may move
            else:
                await asyncio.to_thread(replica.wait_ready, 3600.0, lambda: self._closed)
            async with self._control:
                if self.restore is not None:  # the current weights from the trainer's shards
                    try:
                        await asyncio.to_thread(self.restore, i)
                    except WeightsNotReady as err:
                        self.awaiting.add(i)
                        log.warning("%s server %s: %s", self.backend.name, replica.url, err)
                        return
                elif self.restore_path is not None:
                    await self.backend.load_from_disk(self._client, replica.url, self.restore_path)
                if self.sleeping:
                    await self.backend.sleep(self._client, replica.url)
            self.healthy[i] = True
            self.restarts += 1
            log.warning(
                "%s server %s is back with weights version %d",
                self.backend.name,
                replica.url,
                self.version,
            )
        except Exception as err:  # it stays down; requests go to the other replicas
            log.error("%s server %s did not come back: %s", self.backend.name, replica.url, err)
        finally:
            self._recovering.pop(i, None)

    def wait_healthy(self, timeout_s: float = 300.0) -> bool:
        """Block until every replica serves (True) or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.healthy) and not self._recovering:
                return True
            time.sleep(0.1)
        return False
