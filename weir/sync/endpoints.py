"""The two ends of a weight sync as Ray actor classes: a trainer rank and an engine replica.

They add the transport methods to `TrainerRank` and `EngineWorker`; the driver-side
`WeightSync` calls them. Rank 0 of the trainer keeps the last full weights it gathered, so a
restarted engine can be given the current version without another gather.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import torch

from weir.engine.ray_engine import EngineWorker
from weir.sync.broadcast import BroadcastGroup, TensorMeta
from weir.sync.disk import DiskStore
from weir.sync.hashing import weights_hash
from weir.train.distributed import TrainerRank, free_port


class SyncTrainerRank(TrainerRank):
    """A trainer rank that can publish its weights by broadcast, disk or object store."""

    _full: dict[str, torch.Tensor] | None = None
    _group: BroadcastGroup | None = None

    def gather(self) -> list[TensorMeta]:
        """Collective over the trainer ranks: rank 0 keeps the full weights and returns their
        layout; the other ranks return []."""
        state = self.full_state()
        if self.rank != 0:
            return []
        self._full = state
        return [TensorMeta.of(k, v) for k, v in state.items()]

    def cached(self) -> dict[str, torch.Tensor]:
        """Rank 0: the weights of the last `gather`."""
        assert self._full is not None, "gather() first"
        return self._full

    def sync_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def join(self, host: str, port: int, size: int, name: str, backend: str) -> None:
        self._group = BroadcastGroup(host, port, 0, size, backend=backend, name=name)

    def send(self, buckets: list[list[TensorMeta]]) -> int:
        assert self._group is not None and self._full is not None
        return self._group.send(self._full, buckets)

    def write(self, root: str, version: int) -> str:
        assert self._full is not None
        return str(DiskStore(root).write(self._full, version))

    def weights_hash(self) -> str:
        assert self._full is not None
        return weights_hash(self._full)


class SyncEngineWorker(EngineWorker):
    """An engine replica that can receive weights by broadcast or disk (object store: inherited)."""

    _group: BroadcastGroup | None = None

    async def join(
        self, host: str, port: int, rank: int, size: int, name: str, backend: str
    ) -> None:
        self._group = await asyncio.to_thread(
            BroadcastGroup, host, port, rank, size, backend=backend, name=name
        )

    async def receive(self, buckets: list[list[TensorMeta]], version: int) -> None:
        assert self._group is not None, "join() first"
        state = await asyncio.to_thread(self._group.recv, buckets)
        await self.update_weights(state, version)

    async def load_disk(self, root: str, version: int) -> None:
        _, state = await asyncio.to_thread(DiskStore(root).read, version)
        await self.update_weights(state, version)

    async def weights_hash(self, names: list[str] | None = None) -> str:
        return weights_hash(self.engine.model.state_dict(), names)

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        await super().update_weights(state, version)
