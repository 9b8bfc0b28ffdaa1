"""A server engine's weight updates: pause, load, stamp the version, resume.

Part of `weir.engine.server_engine.ServerEngine` (a mixin: the methods use the engine's state and
loop). Every update pauses the streams in flight (their tokens kept), has every live server (and
any restarted one waiting for weights, `awaiting`) load the new weights, sets the version and
resumes: tokens before the update carry the old version, tokens after it the new one. A server
weir started whose process has exited when an update starts is marked down and restarted, and
gets the weights when it is back (a broadcast to it would fail the update). One that dies during
the update fails that load; the servers found gone then (or left wedged in an aborted broadcast,
`weir.sync.server_sync.DeliveryFailed`) are restarted and the load goes again to the others
(`update_retries`). How the
weights travel is the caller's: a safetensors directory each server reads (`update_weights`,
`load_weights_from_disk`), a LoRA adapter (`update_adapter_sync`), or any loader coroutine
(`update_with_sync`: weir.sync.server_sync streams the trainer's shards over a torch.distributed
group).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from weir.engine.servers import Replica

__all__ = ["WeightUpdates"]

log = logging.getLogger("weir.engine.server_engine")


class WeightUpdates:
    """The weight-update half of `ServerEngine` (see the module docstring)."""

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        path = await asyncio.to_thread(self._write, named_tensors, version)
        await self._in_loop(self._load(path, version))

    async def load_weights_from_disk(self, path: str | Path, version: int) -> None:
        """Load a safetensors (HF) directory the servers can read, then set `version`."""
        await self._in_loop(self._load(str(path), version))

    def update_with_sync(
        self, load: Callable[[list[tuple[int, Replica]]], Coroutine], version: int
    ) -> None:
        """Pause, run ``await load(replicas)`` in the engine's loop (the live replicas and those
        waiting for weights, `awaiting`, with their indices; it must leave every one of them
        holding the new weights), set `version`, resume. The hook of weight transports other than
        a directory (`weir.sync.server_sync`)."""
        self._call(self._load_with(load, version, path=None))

    def update_adapter_sync(self, path: str | Path, name: str, version: int) -> None:
        """Load the LoRA adapter directory `path` into every server as `name` (the previous one
        unloaded) and run requests with it from then on (lora.sync=adapter; vLLM), then set
        `version`."""
        old = getattr(self.backend, "adapter", None)

        async def load(replicas: list[tuple[int, Replica]]) -> None:
            await asyncio.gather(
                *(
                    self.backend.load_adapter(self._client, r.url, str(path), name, old)
                    for _, r in replicas
                )
            )
            self.backend.adapter = name

        self._call(self._load_with(load, version, path=None))

    def run(self, coro: Coroutine) -> Any:
        """Run `coro` in the engine's loop (where its HTTP client lives) and wait for its result."""
        return self._call(coro)

    def update_weights_sync(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        path = self._write(named, version)
        self._call(self._load(path, version))

    def update_weights_from_disk_sync(self, path: str | Path, version: int) -> None:
        self._call(self._load(str(path), version))

    def _write(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> str:
        """Write the weights as a loadable model directory: safetensors plus the model's config
        files (SGLang's loader reads config.json next to the weights)."""
        import shutil

        from weir.sync.disk import DiskStore

        out = DiskStore(self.weights_dir).write(dict(named), version)
        if self.model_dir is not None:
            for f in Path(self.model_dir).glob("*.json"):
                if not f.name.endswith(".index.json"):
                    shutil.copy(f, out / f.name)
        return str(out)

    async def _load(self, path: str, version: int) -> None:
        """Pause, load `path` into every healthy server, set `version`, resume (if it was running)."""

        async def from_disk(replicas: list[tuple[int, Replica]]) -> None:
            digest = {"digest": True} if self.verify_loads else {}
            await asyncio.gather(
                *(
                    self.backend.load_from_disk(self._client, r.url, path, **digest)
                    for _, r in replicas
                )
            )

        await self._load_with(from_disk, version, path=path)

    async def _load_or_shed(
        self, load: Callable, targets: list[tuple[int, Replica]]
    ) -> list[tuple[int, Replica]]:
        """``await load(targets)``; after a failure, the targets found gone or left wedged are
        restarted (`_shed`) and the load goes again to the others, each round with fewer servers.
        Raises the failure when no server was lost in it (it is not theirs). Returns the targets
        that took the weights; none when every one was lost (each is given the new weights when
        it is back: `restore`)."""
        while True:
            try:
                await load(targets)
                return targets
            except Exception as err:
                left = await self._shed(targets, getattr(err, "wedged", frozenset()))
                if len(left) == len(targets):
                    raise
                self.update_retries += 1
                log.warning(
                    "%s: %d of %d servers lost during a weight update (%s); it goes again to "
                    "the others, the lost ones restart and get the weights when they are back",
                    self.backend.name,
                    len(targets) - len(left),
                    len(targets),
                    err,
                )
                if not left:  # every one restarts and takes these weights when it is back
                    return []
                targets = left

    async def _load_with(self, load: Callable, version: int, *, path: str | None) -> None:
        async with self._control:
            was_running = self._running.is_set()
            await self._pause()
            try:
                if self.sleeping:
                    await self._wake_servers()
                targets = [
                    (i, r)
                    for i, r in enumerate(self.replicas)
                    if self.healthy[i] or i in self.awaiting
                ]
                targets = await self._survivors(targets)  # died since its last request
                targets = await self._load_or_shed(load, targets)
                for i, _ in targets:
                    if i in self.awaiting:  # restarted, back with these weights
                        self.awaiting.discard(i)
                        self.healthy[i] = True
                        self.restarts += 1
                self.restore_path = path
                self.version = version
            finally:
                if self.sleeping:
                    await self._sleep_servers()
                if was_running:
                    self._running.set()
