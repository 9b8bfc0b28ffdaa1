"""The driver side of a weight sync on Ray: trainer rank 0 -> every engine replica, versioned.

Transports:

- ``broadcast``: a torch.distributed group of rank 0 and the engines (gloo on CPU, NCCL on GPU),
  bucketed. The group is re-formed when the set of live replicas changes (a replica died).
- ``disk``: rank 0 writes a versioned safetensors directory (`DiskStore`); engines read it.
- ``object_store``: rank 0's full weights go into Ray's object store; engines read them there.

A replica that Ray restarted gets the current weights through the object store from rank 0's
cache (`restore`), before the router lets it take requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Any

from weir.sync.broadcast import TensorMeta, plan_buckets

log = logging.getLogger(__name__)

TRANSPORTS = ("broadcast", "disk", "object_store")


class WeightSync:
    """Publishes the trainer's weights to the router's replicas.

    Args:
        trainer: a `TrainerGroup` of `SyncTrainerRank` actors.
        router: the engines' `Router` (its `restore` should be this object's `restore`).
        transport: one of TRANSPORTS.
        disk_dir: the disk transport's directory (shared by trainer and engines).
        bucket_mb: broadcast bucket size.
        backend: "gloo" or "nccl" for the broadcast group.
    """

    def __init__(
        self,
        trainer,
        router,
        transport: str = "broadcast",
        *,
        disk_dir: str | Path | None = None,
        bucket_mb: float = 64.0,
        backend: str = "gloo",
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(
                f"cluster.weight_sync: unknown transport {transport!r}; use one of {TRANSPORTS}"
            )
        if transport == "disk" and disk_dir is None:
            raise ValueError("the disk transport needs a directory (cluster.sync_dir)")
        self.trainer, self.router, self.transport = trainer, router, transport
        self.disk_dir = str(disk_dir) if disk_dir is not None else None
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.backend = backend
        self.version = router.version
        self._members: tuple[int, ...] | None = None  # replicas in the current broadcast group
        self._generation = itertools.count()
        self._buckets: list[list[TensorMeta]] | None = None
        self._pushed = False
        self._lock = threading.Lock()  # a push and a restore never interleave

    def push(self, version: int) -> dict[str, float]:
        """Gather full weights on rank 0 and deliver them as `version`; returns timings."""
        with self._lock:
            return self._push(version)

    def _push(self, version: int) -> dict[str, float]:
        import ray

        start = time.perf_counter()
        metas = self.trainer.call("gather")[0]
        gathered = time.perf_counter()
        nbytes = sum(m.nbytes for m in metas)
        live = self.router.live()
        if self.transport == "broadcast":
            try:
                self._broadcast(metas, live, version)
            except Exception as err:  # a replica died mid-broadcast: deliver this one another way
                log.warning("weight broadcast failed (%s); using the object store", err)
                self._members = None
                self._object_store(self.router.live(), version)
        elif self.transport == "disk":
            self.trainer.get([self.trainer.rank0.write.remote(self.disk_dir, version)])
            ray.get([r.load_disk.remote(self.disk_dir, version) for _, r in live])
        else:
            self._object_store(live, version)
        self._pushed = True
        self.version = self.router.version = version
        end = time.perf_counter()
        return {
            "time/sync": end - start,
            "sync/gather_s": gathered - start,
            "sync/deliver_s": end - gathered,
            "sync/mb": nbytes / 2**20,
            "sync/mb_per_s": nbytes / 2**20 / max(end - gathered, 1e-9),
            "cluster/engine_retries": float(self.router.retries),
            "cluster/engine_restarts": float(self.router.restarts),
        }

    def _broadcast(
        self, metas: list[TensorMeta], live: list[tuple[int, Any]], version: int
    ) -> None:
        import ray

        self._buckets = plan_buckets(metas, self.bucket_bytes)
        if self._members != tuple(i for i, _ in live):
            self._form_group(live)
        send = self.trainer.rank0.send.remote(self._buckets)
        recv = [r.receive.remote(self._buckets, version) for _, r in live]
        self.trainer.get([send])
        ray.get(recv)

    def _object_store(self, live: list[tuple[int, Any]], version: int) -> None:
        import ray

        state = self.trainer.rank0.cached.remote()  # stays in the object store, read by each
        ray.get([r.update_weights.remote(state, version) for _, r in live])

    def _form_group(self, live: list[tuple[int, Any]]) -> None:
        import ray

        host, port = self.trainer.get([self.trainer.rank0.sync_address.remote()])[0]
        name = f"weir-sync-{next(self._generation)}"
        size = len(live) + 1
        refs = [self.trainer.rank0.join.remote(host, port, size, name, self.backend)]
        refs += [
            r.join.remote(host, port, k + 1, size, name, self.backend)
            for k, (_, r) in enumerate(live)
        ]
        ray.get(refs)
        self._members = tuple(i for i, _ in live)

    def restore(self, index: int, actor: Any) -> None:
        """Give a restarted replica the current weights (object store, from rank 0's cache)."""
        import ray

        with self._lock:
            if not self._pushed:
                return  # nothing was pushed yet: the replica loaded the initial weights itself
            if self.transport == "disk":
                ray.get(actor.load_disk.remote(self.disk_dir, self.version))
            else:
                state = self.trainer.rank0.cached.remote()
                ray.get(actor.update_weights.remote(state, self.version))
            self._members = None  # the broadcast group changes: form a new one next push
