"""The driver side of a weight sync on Ray: trainer shards -> every engine replica, versioned.

Transports:

- ``broadcast`` (default): streamed from the FSDP2 shards bucket by bucket (`SyncTrainerRank.stream`):
  every trainer rank gathers the bucket on its device, rank 0 sends it and frees it. Engines on
  rank 0's own GPU (or, colocated on the CPU, its host) take it by memory handle (CUDA IPC /
  shared memory: NCCL refuses two ranks on one GPU); the others through a torch.distributed group
  of rank 0 and them (NCCL on GPUs, gloo on CPU), re-formed when the set of live replicas changes.
  No process holds the full weights.
- ``disk``: rank 0 gathers the full weights and writes a versioned safetensors directory
  (`DiskStore`); engines read it.
- ``object_store``: rank 0 gathers the full weights into Ray's object store; engines read them.

A replica that dies during a broadcast fails the push; the driver aborts the group (its abort key
in rank 0's TCPStore: every member leaves within a quarter of a second, `weir.sync.broadcast
.finish`) and pushes once more to the replicas that answer, in a new group. A replica that Ray
restarted gets the current version from a live peer replica, or, when none is left, streamed from
the shards as long as the trainer has not changed them since the last push.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

from weir.sync.broadcast import ABORT_GRACE_S, TensorMeta, plan_buckets, signal_abort

log = logging.getLogger(__name__)

TRANSPORTS = ("broadcast", "disk", "object_store")


class NotRestorable(RuntimeError):
    """A restarted replica cannot get the current version yet (the router asks again)."""


class WeightSync:
    """Publishes the trainer's weights to the router's replicas.

    Args:
        trainer: a `TrainerGroup` of `SyncTrainerRank` actors.
        router: the engines' `Router` (its `restore` should be this object's `restore`).
        transport: one of TRANSPORTS.
        disk_dir: the disk transport's directory (shared by trainer and engines).
        bucket_mb: bucket size of the streamed sync.
        backend: "gloo" or "nccl" for the broadcast group.
        dtype: the engines' weight dtype (e.g. "bfloat16"): floating tensors are cast to it on the
            trainer's device before they travel; None sends the trainer's dtype.
        host_handles: engines on rank 0's host (both on the CPU) take buckets by shared-memory
            handle instead of the broadcast group (colocated placement). Engines on rank 0's GPU
            always take CUDA IPC handles.
        role: the policy whose weights these engines run (multi_agent.policies=separate), "" for
            the one policy.
        verify: after each push, check every replica's weights against the trainer's
            (`cluster.verify_sync`).
    """

    def __init__(
        self,
        trainer,
        router,
        transport: str = "broadcast",
        *,
        disk_dir=None,
        bucket_mb: float = 64.0,
        backend: str = "gloo",
        dtype: str | None = None,
        host_handles: bool = False,
        role: str = "",
        verify: bool = False,
    ) -> None:
        self.role, self.verify = role, verify
        if transport not in TRANSPORTS:
            raise ValueError(
                f"cluster.weight_sync: unknown transport {transport!r}; use one of {TRANSPORTS}"
            )
        if transport == "disk" and disk_dir is None:
            raise ValueError("the disk transport needs a directory (cluster.sync_dir)")
        self.trainer, self.router, self.transport = trainer, router, transport
        self.disk_dir = str(disk_dir) if disk_dir is not None else None
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.backend, self.dtype, self.host_handles = backend, dtype, host_handles
        self.version = router.version
        self._members: tuple[int, ...] | None = None  # replicas in the current broadcast group
        self._group: tuple[str, int, str] | None = None  # its rank 0's store (host, port), name
        self._shared: list[int] = []  # replicas that take memory handles
        self._generation = itertools.count()
        self._metas: list[TensorMeta] | None = None
        self._buckets: tuple[int, list[list[TensorMeta]]] | None = None  # (bucket bytes, plan)
        self._pushed = False
        self._trained_at_push = 0
        self.retries = 0  # pushes that went again after a replica failed during them
        self._lock = threading.Lock()  # a push and a restore never interleave

    def push(self, version: int) -> dict[str, float]:
        """Deliver the trainer's current weights as `version`; returns timings."""
        with self._lock:
            return self._push(version)

    def _push(self, version: int) -> dict[str, float]:
        import ray

        start = time.perf_counter()
        live = self.router.live()
        gathered = start
        offload_s = 0.0
        if self.transport == "broadcast":
            try:
                nbytes, offload_s = self._stream(live, version)
            except Exception as err:  # a replica died mid-sync: once more with the live ones
                log.warning("weight sync failed (%s); forming a new group and retrying", err)
                self.retries += 1
                self._members = None
                nbytes, offload_s = self._stream(self._answering(self.router.live()), version)
        else:
            metas = self.trainer.call("gather", self.role)[0]
            gathered = time.perf_counter()
            nbytes = sum(m.nbytes for m in metas)
            try:
                if self.transport == "disk":
                    self.trainer.get([self.trainer.rank0.write.remote(self.disk_dir, version)])
                    ray.get([r.load_disk.remote(self.disk_dir, version) for _, r in live])
                else:
                    state = self.trainer.rank0.cached.remote()
                    ray.get([r.update_weights.remote(state, version) for _, r in live])
                    del state
            finally:
                self.trainer.get([self.trainer.rank0.release.remote()])
        self._pushed = True
        self._trained_at_push = getattr(self.trainer, "trained", 0)
        self.version = self.router.version = version
        end = time.perf_counter()
        deliver = end - gathered - offload_s
        checked = {"sync/verified": self.check(version)} if self.verify else {}
        return {
            **checked,
            "time/sync": end - start,
            "sync/gather_s": gathered - start,
            "sync/deliver_s": deliver,
            "sync/offload_s": offload_s,
            "sync/mb": nbytes / 2**20,
            "sync/mb_per_s": nbytes / 2**20 / max(deliver, 1e-9),
            "cluster/engine_retries": float(self.router.retries),
            "cluster/engine_restarts": float(self.router.restarts),
            "cluster/sync_retries": float(self.retries),
        }

    def check(self, version: int) -> float:
        """1.0 when every live replica holds exactly the trainer's weights (hashes of the names
        that travel, gathered from the shards one tensor at a time); raises otherwise."""
        import ray

        names = [m.name for bucket in self._layout() for m in bucket]
        want = self.trainer.call("wire_hash", self.dtype, self.role)[0]
        live = self.router.live()
        got = ray.get([r.weights_hash.remote(names) for _, r in live])
        wrong = [i for (i, _), h in zip(live, got, strict=True) if h != want]
        if wrong:
            raise RuntimeError(
                f"weight sync: engine replicas {wrong} hold other weights than the trainer after "
                f"version {version} (cluster.verify_sync)"
            )
        return 1.0

    @staticmethod
    def _answering(live: list[tuple[int, Any]], timeout_s: float = 30.0) -> list[tuple[int, Any]]:
        """The replicas of `live` that answer a ping."""
        import ray

        refs = {r.ping.remote(): (i, r) for i, r in live}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        out = []
        for ref in ready:
            try:
                ray.get(ref)
                out.append(refs[ref])
            except Exception:
                continue
        return sorted(out, key=lambda x: x[0])

    def _layout(self) -> list[list[TensorMeta]]:
        """The buckets of a sync. When every replica takes memory handles, a bucket may be as
        large as the largest tensor (which travels alone in one anyway): rank 0's two staging
        buffers are that large already, and fewer buckets are fewer round trips."""
        if self._metas is None:
            self._metas = self.trainer.get(
                [self.trainer.rank0.layout.remote(self.dtype, self.role)]
            )[0]
        handles_only = self._members is not None and not self._members
        size = self.bucket_bytes
        if handles_only:
            size = max(size, max((m.nbytes for m in self._metas), default=0))
        if self._buckets is None or self._buckets[0] != size:
            self._buckets = (size, plan_buckets(self._metas, size))
        return self._buckets[1]

    def _stream(self, live: list[tuple[int, Any]], version: int) -> tuple[int, float]:
        """Bucket by bucket from the shards to the `live` replicas; returns the bytes per replica
        and the seconds rank 0's offload after it took."""
        import ray

        if self._members is None or set(self._members) | set(self._shared) != {i for i, _ in live}:
            self._form_group(live)
        buckets = self._layout()
        actors = dict(live)
        shared = [actors[i] for i in self._shared]
        recv = [actors[i].receive.remote(buckets, version) for i in self._members or ()]
        recv += [a.receive_shared.remote(buckets, version) for a in shared]
        with self.trainer._collective:
            ranks = [
                rank.stream.remote(buckets, shared if r == 0 else [], version, self.role)
                for r, rank in enumerate(self.trainer.ranks)
            ]
            if _first_failure(ranks + recv) is not None and self._members:
                self._abort(ranks + recv)  # the others would wait for the failed member
            sent = self.trainer.get(ranks)[0]
        ray.get(recv)
        return sent

    def _abort(self, refs: list) -> None:
        """Abort the current broadcast group (a member failed half way): set its abort key and
        give every call in it `ABORT_GRACE_S` to end."""
        import ray

        self._members = None
        if self._group is not None:
            signal_abort(*self._group)
        ray.wait(refs, num_returns=len(refs), timeout=ABORT_GRACE_S)

    def _form_group(self, live: list[tuple[int, Any]]) -> None:
        """Split the live replicas into handle takers (rank 0's device) and a broadcast group. A
        member that fails to join (Ray reports it dead) aborts the forming group, as a failure
        during a push does: the others would wait for it in the rendezvous until its timeout."""
        import ray

        self._members = None
        root = self.trainer.get([self.trainer.rank0.device_key.remote()])[0]
        keys = ray.get([r.device_key.remote() for _, r in live])
        same = [k == root and (k[1] != "cpu" or self.host_handles) for k in keys]
        self._shared = [i for (i, _), s in zip(live, same, strict=True) if s]
        members = [(i, r) for (i, r), s in zip(live, same, strict=True) if not s]
        if not members:
            self.trainer.get([self.trainer.rank0.leave.remote(self.role)])
        else:
            host, port = self.trainer.get([self.trainer.rank0.sync_address.remote()])[0]
            name = f"weir-sync-{self.role}-{next(self._generation)}"
            size = len(members) + 1
            refs = [
                self.trainer.rank0.join.remote(
                    host, port, size, name, self.backend, "weir", False, self.role
                )
            ]
            refs += [
                r.join.remote(host, port, k + 1, size, name, self.backend)
                for k, (_, r) in enumerate(members)
            ]
            self._group = (host, port, name)
            failed = _first_failure(refs)
            if failed is not None:
                self._abort(refs)
                raise failed
        self._members = tuple(i for i, _ in members)

    def restore(self, index: int, actor: Any) -> None:
        """Give a restarted replica the current version: from a live peer's weights (through the
        object store), else streamed from the trainer's shards if they are still that version;
        otherwise `NotRestorable` (the router retries after the next push)."""
        import ray

        with self._lock:
            if not self._pushed:
                return  # nothing was pushed yet: the replica loaded the initial weights itself
            self._members = None  # the broadcast group changes: form a new one next push
            if self.transport == "disk":
                ray.get(actor.load_disk.remote(self.disk_dir, self.version))
                return
            peers = [r for i, r in self.router.live() if i != index]
            if peers:
                ray.get(actor.update_weights.remote(peers[0].state.remote(), self.version))
                return
            if getattr(self.trainer, "trained", 0) != self._trained_at_push:
                raise NotRestorable(
                    f"replica {index}: no live peer, and the trainer moved past version "
                    f"{self.version}; it rejoins after the next push"
                )
            self._stream([(index, actor)], self.version)
            self._members = None


def _first_failure(refs: list) -> Exception | None:
    """Wait for `refs`: the error of the first that fails (the others may be pending), None once
    every one succeeded."""
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except Exception as err:
            return err
    return None
