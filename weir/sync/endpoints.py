"""The two ends of a weight sync as Ray actor classes: a trainer rank and an engine replica.

They add the transport methods to `TrainerRank` and `EngineWorker`; the driver-side `WeightSync`
calls them. The default path streams from the FSDP2 shards (`stream`): bucket by bucket, every
trainer rank takes part in gathering the bucket on its device, rank 0 hands it to the engines
(broadcast group, or memory handles for engines on its own GPU / host) and frees it. Only the disk
and object-store transports gather the full weights on rank 0 (`gather`), and drop them after the
push (`release`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from weir.engine.ray_engine import EngineWorker
from weir.sync.broadcast import BroadcastGroup, TensorMeta
from weir.sync.disk import DiskStore
from weir.sync.handles import Handle, alloc_shareable, open_handle, share
from weir.sync.hashing import weights_hash
from weir.sync.host_memory import peak_rss, reset_peak_rss, rss
from weir.sync.shards import gather_buckets, sharded_hash, unique_tensors, wire_metas
from weir.train.batch import TrainBatch
from weir.train.distributed import TrainerRank, free_port
from weir.train.offload import StateMover, host_bytes, move_trainer

HANDLE_TIMEOUT_S = 600.0


def device_key(device: torch.device) -> tuple[str, str]:
    """(Ray node id, GPU uuid or "cpu"): two processes with equal keys share a device."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    if device.type == "cuda":
        return node, str(torch.cuda.get_device_properties(device).uuid)
    return node, "cpu"


class SyncTrainerRank(TrainerRank):
    """A trainer rank that publishes its weights from its shards, or by disk / object store."""

    _full: dict[str, torch.Tensor] | None = None
    _group: BroadcastGroup | None = None
    _mover: StateMover | None = None

    @property
    def _offloads(self) -> bool:
        """Colocated on a GPU with cluster.offload_trainer: off the device between train calls."""
        c = self.settings.cluster
        return c.colocate and c.offload_trainer and self.device.startswith("cuda")

    def setup(self, host: str, port: int) -> int:
        rank = super().setup(host, port)
        self.offload()  # the engines generate first
        return rank

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """Train on the device; colocated, the parameters and optimizer state live in host memory
        before. After it the optimizer state leaves at once and the parameters stay for the
        weight sync that follows, which reads them on the device and then offloads them
        (`stream`): otherwise every step would move the float32 parameters to the host and back
        only to read them."""
        start = time.perf_counter()
        self.onload(overlap_state=True)
        onloaded = time.perf_counter()
        try:
            stats = super().train(batch)
        finally:
            trained = time.perf_counter()
            self.offload(keep_params=True)
        if self._offloads:
            stats["time/onload"] = onloaded - start
            stats["time/offload"] = time.perf_counter() - trained
        return stats

    def _on_device(self, method: str, *args: Any) -> Any:
        self.onload()
        try:
            return getattr(super(), method)(*args)
        finally:
            self.offload()

    # the checkpoint paths run FSDP2 collectives on the device too
    def full_state(self) -> dict[str, torch.Tensor]:
        return self._on_device("full_state")

    def trainer_state(self) -> dict[str, Any]:
        return self._on_device("trainer_state")

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self._on_device("load_trainer_state", state)

    def save(self, path: str) -> dict[str, dict[str, Any]]:
        return self._on_device("save", path)

    def load(self, path: str) -> None:
        self._on_device("load", path)

    def load_hf(self, model_dir: str) -> None:
        self._on_device("load_hf", model_dir)

    def save_hf(self, out: str, bucket_mb: float) -> list[str]:
        return self._on_device("save_hf", out, bucket_mb)

    @property
    def _state_mover(self) -> StateMover:
        if self._mover is None:
            pinned = self.settings.cluster.offload_pinned
            self._mover = StateMover(torch.device(self.device), pinned=pinned)
        return self._mover

    def offload(self, *, keep_params: bool = False) -> int:
        """Colocated on a GPU: move the parameter shards (unless `keep_params`), the reference
        model's and the optimizer state to host memory, and free the gradients (the next step
        zeroes them before its backward, so moving them would copy dead values both ways). A
        weight sync works either way: it moves each offloaded shard to the device as it gathers
        it. Returns the bytes moved; 0 when not colocated or on the CPU.

        After a step (`keep_params`) the optimizer state leaves on a stream of its own
        (`StateMover`) while the weight sync that follows runs; the sync's own offload (without
        `keep_params`) completes it."""
        if not self._offloads or self.actor is None:
            return 0
        a = self.actor
        a.optimizer.zero_grad(set_to_none=True)
        pinned = self.settings.cluster.offload_pinned
        host = torch.device("cpu")
        if keep_params:  # the reference leaves now, and the cached memory goes back to the device
            moved = move_trainer([a.ref], None, host, pinned=pinned)
            return moved + self._state_mover.to_host(a.optimizer)
        self._state_mover.wait()
        return move_trainer([a.model, a.ref], a.optimizer, host, pinned=pinned)

    def onload(self, *, overlap_state: bool = False) -> int:
        """Undo `offload`; returns the bytes moved. With `overlap_state` (before a step) the
        optimizer state comes on a stream of its own while the forward and backward run, and the
        optimizer's step waits for it (`StateMover`)."""
        if not self._offloads or self.actor is None:
            return 0
        a = self.actor
        pinned = self.settings.cluster.offload_pinned
        device = torch.device(self.device)
        self._state_mover.wait()  # a move still in flight lands before this one starts
        if not overlap_state:
            return move_trainer([a.model, a.ref], a.optimizer, device, pinned=pinned)
        moved = move_trainer([a.model, a.ref], None, device, pinned=pinned)
        return moved + self._state_mover.to_device(a.optimizer, device)

    def device_memory(self) -> dict[str, int]:
        """CUDA memory this process holds (allocated / reserved by torch), and the bytes of its
        parameters and optimizer state in host memory, pinned or not (`host_bytes`); device
        figures are zeros on CPU."""
        a = self.actor
        host = host_bytes([a.model, a.ref], a.optimizer) if a is not None else {}
        if not self.device.startswith("cuda"):
            return {"allocated": 0, "reserved": 0, **host}
        return {
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
            **host,
        }

    def _sharded(self) -> dict[str, torch.Tensor]:
        """This rank's shards by name (DTensors; no gather; whole tensors on a group of one rank),
        tied tensors once."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.actor is not None, "setup() first"
        return unique_tensors(get_model_state_dict(self.actor.model))

    def layout(self, dtype: str | None = None) -> list[TensorMeta]:
        """Names and full shapes of the weights an engine loads, floating tensors in `dtype` (the
        engines' dtype; None keeps the trainer's)."""
        return wire_metas(self._sharded(), getattr(torch, dtype) if dtype else None)

    def device_key(self) -> tuple[str, str]:
        return device_key(torch.device(self.device))

    def sync_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def join(self, host: str, port: int, size: int, name: str, backend: str) -> None:
        self._group = BroadcastGroup(host, port, 0, size, backend=backend, name=name)

    def leave(self) -> None:
        """No broadcast group (every engine takes handles)."""
        self._group = None

    def stream(
        self, buckets: list[list[TensorMeta]], shared: list[Any], version: int
    ) -> tuple[int, float]:
        """Collective over the trainer ranks: gather bucket after bucket from the shards; rank 0
        broadcasts each to its group and hands it to the engine actors in `shared` (same device)
        by memory handle. Returns (the bytes rank 0 delivered, the seconds the offload after it
        took). Offloads the parameters `train` left on the device for it, also on error.

        The handles point into two staging buffers that the buckets take in turn (`_Staging`): an
        engine opens each buffer once per sync, and rank 0 fills the next bucket while the
        engines copy the last one out of the other buffer."""
        root = self.rank == 0
        sent = 0
        error: Exception | None = None
        device = torch.device(self.device)
        staging = _Staging(buckets, device) if root and shared else None
        try:
            for flat in gather_buckets(
                self._sharded(),
                buckets,
                device,
                root=root,
                into=None if staging is None else staging.take,
            ):
                if flat is None or error is not None:
                    continue  # after a failed send rank 0 still takes part in the gathers
                try:
                    self._deliver(flat, shared, version, staging)
                except Exception as err:  # an engine died: the driver retries with the live ones
                    error = err
                sent += flat.numel() * flat.element_size()
                del flat
                if staging is not None and staging.error is not None:
                    error = staging.error
            if staging is not None:
                staging.drain()
                error = error or staging.error
        finally:
            del staging
            if device.type == "cuda":  # buffers the engines mapped are freed once they let go
                torch.cuda.ipc_collect()
            start = time.perf_counter()
            self.offload()
            offload_s = time.perf_counter() - start
        if error is not None:
            raise RuntimeError(f"weight sync: delivery failed ({error})")
        return sent, offload_s

    def _deliver(
        self,
        flat: torch.Tensor,
        shared: list[Any],
        version: int,
        staging: _Staging | None = None,
    ) -> None:
        """One bucket to the broadcast group and, by its staging buffer's memory handle, to the
        engines in `shared` (their copies are waited for before the buffer is reused)."""
        if self._group is not None:
            self._group.send_flat(flat)
        if shared:
            assert staging is not None, "handles go through rank 0's staging buffers"
            if flat.is_cuda:  # the engines read it on their own streams: the writes land first
                torch.cuda.current_stream(flat.device).synchronize()
            refs = [e.put_shared.remote(staging.handle, version, staging.index) for e in shared]
            staging.hand_over(refs)

    def gather(self) -> list[TensorMeta]:
        """Collective: rank 0 keeps the full weights (host memory) until `release` and returns their
        layout; the other ranks return []. For the disk and object-store transports only."""
        state = self.full_state()
        if self.rank != 0:
            return []
        self._full = state
        return [TensorMeta.of(k, v) for k, v in state.items()]

    def release(self) -> None:
        self._full = None

    def cached(self) -> dict[str, torch.Tensor]:
        """Rank 0: the weights of the last `gather`."""
        assert self._full is not None, "gather() first"
        return self._full

    def write(self, root: str, version: int) -> str:
        assert self._full is not None
        return str(DiskStore(root).write(self._full, version))

    def weights_hash(self, dtype: str | None = None) -> str:
        """Collective: `weights_hash` of the full weights as the engines get them (tied tensors
        under both names), gathered one tensor at a time."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.actor is not None, "setup() first"
        state = get_model_state_dict(self.actor.model)
        return sharded_hash(
            state, torch.device(self.device), getattr(torch, dtype) if dtype else None
        )

    def memory(self) -> dict[str, int]:
        """This process's resident memory now and at its peak since `reset_memory_peak` (bytes)."""
        return {"rss": rss(), "peak": peak_rss()}

    def reset_memory_peak(self) -> None:
        reset_peak_rss()


class _Staging:
    """Rank 0's two shareable buffers for one sync, each as large as the largest bucket; bucket
    after bucket takes the one the engines are not reading (`take`), and is handed over by that
    buffer's handle, made once (`handle` / `hand_over`). Freed when the sync ends."""

    def __init__(self, buckets: list[list[TensorMeta]], device: torch.device) -> None:
        largest = max((sum(m.nbytes for m in b) for b in buckets), default=1)
        count = 2 if len(buckets) > 1 else 1
        self.buffers = [alloc_shareable(largest, torch.uint8, device) for _ in range(count)]
        self.handles = [share(b) for b in self.buffers]
        self.pending: list[list[Any]] = [[] for _ in self.buffers]
        self.current = -1
        self.index = -1  # of the bucket in the current buffer
        self.error: Exception | None = None

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next buffer, as `numel` elements of `dtype`, once the engines copied what it held."""
        self.current = (self.current + 1) % len(self.buffers)
        self.index += 1
        self._wait(self.current)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.buffers[self.current][:nbytes].view(dtype)

    @property
    def handle(self) -> Handle:
        return self.handles[self.current]

    def hand_over(self, refs: list[Any]) -> None:
        """The engines' calls reading the current buffer (each returns once it copied it)."""
        self.pending[self.current] = refs

    def _wait(self, k: int) -> None:
        """Wait for the engines reading buffer `k`; a failure is kept in `error` (not raised:
        rank 0 must still take part in every gather of the sync)."""
        import ray

        refs, self.pending[k] = self.pending[k], []
        if refs and self.error is None:
            try:
                ray.get(refs, timeout=HANDLE_TIMEOUT_S)
            except Exception as err:  # noqa: BLE001 - an engine died: the sync reports it
                self.error = err

    def drain(self) -> None:
        for k in range(len(self.buffers)):
            self._wait(k)


class _Inbox:
    """Buckets handed to an engine by memory handle, consumed by one weight update."""

    def __init__(self) -> None:
        self.items: queue.Queue[tuple[int | None, Handle, threading.Event]] = queue.Queue()
        self.failed: BaseException | None = None
        self._early: dict[int, tuple[Handle, threading.Event]] = {}

    def release(self) -> None:
        """Let every sender still waiting on a bucket that was never read return."""
        while not self.items.empty():
            self.items.get_nowait()[2].set()
        for _, done in self._early.values():
            done.set()

    def _take(self, index: int) -> tuple[Handle, threading.Event]:
        """Bucket `index`'s handle: buckets may come in out of order (rank 0 hands the next one
        over before the engine has copied the last), so one that is early waits its turn."""
        while index not in self._early:
            try:
                at, handle, done = self.items.get(timeout=HANDLE_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(
                    "no bucket from trainer rank 0 within the handle timeout"
                ) from None
            self._early[index if at is None else at] = (handle, done)
        return self._early.pop(index)

    def stream(
        self, buckets: list[list[TensorMeta]], device: torch.device
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every bucket, as views of the buffer its handle maps; a buffer that
        comes again (rank 0's staging) is mapped once. The mappings go at the end."""
        opened: dict[Handle, torch.Tensor] = {}
        try:
            for index, bucket in enumerate(buckets):
                handle, done = self._take(index)
                if handle not in opened:
                    opened[handle] = open_handle(handle, device).view(torch.uint8)
                dtype = bucket[0].torch_dtype
                nbytes = sum(m.nbytes for m in bucket)
                flat = opened[handle][:nbytes].view(dtype)
                for m, part in zip(bucket, flat.split([m.numel for m in bucket]), strict=True):
                    yield m.name, part.view(m.shape)
                if flat.is_cuda:  # the copies must be done before rank 0 reuses the memory
                    torch.cuda.current_stream(flat.device).synchronize()
                del flat, part
                if bucket is buckets[-1]:  # let go of the mappings before rank 0 frees them
                    opened.clear()
                done.set()
        finally:
            opened.clear()


class SyncEngineWorker(EngineWorker):
    """An engine replica that receives weights by broadcast, memory handle, disk or object store."""

    _group: BroadcastGroup | None = None
    _inboxes: dict[int, _Inbox] | None = None

    def _inbox(self, version: int) -> _Inbox:
        if self._inboxes is None:
            self._inboxes = {}
        return self._inboxes.setdefault(version, _Inbox())

    async def device_key(self) -> tuple[str, str]:
        return device_key(next(self.engine.model.parameters()).device)

    async def join(
        self, host: str, port: int, rank: int, size: int, name: str, backend: str
    ) -> None:
        self._group = await asyncio.to_thread(
            BroadcastGroup, host, port, rank, size, backend=backend, name=name
        )

    async def receive(self, buckets: list[list[TensorMeta]], version: int) -> None:
        """Load the buckets rank 0 broadcasts, each as it arrives, between decode steps."""
        assert self._group is not None, "join() first"
        stream = self._group.recv_stream(buckets)
        await asyncio.to_thread(self.engine.update_weights_sync, stream, version)

    async def receive_shared(self, buckets: list[list[TensorMeta]], version: int) -> None:
        """Load the buckets rank 0 hands over by `put_shared`, each as it arrives."""
        inbox = self._inbox(version)
        try:
            stream = inbox.stream(buckets, next(self.engine.model.parameters()).device)
            await asyncio.to_thread(self.engine.update_weights_sync, stream, version)
        except BaseException as err:
            inbox.failed = err
            raise
        finally:
            self._inboxes.pop(version, None)
            if inbox.failed is not None:  # a bucket still on its way finds it failed
                self._inboxes[version] = inbox
            inbox.release()

    async def put_shared(self, handle: Handle, version: int, index: int | None = None) -> None:
        """Rank 0: here is bucket `index` (None: the next) of `version`; returns once it is copied
        into the model (or the update failed)."""
        inbox = self._inbox(version)
        if inbox.failed is not None:
            raise RuntimeError(f"the engine failed to load version {version}: {inbox.failed}")
        done = threading.Event()
        inbox.items.put((index, handle, done))
        await asyncio.to_thread(done.wait, HANDLE_TIMEOUT_S)
        if inbox.failed is not None:
            raise RuntimeError(f"the engine failed to load the bucket: {inbox.failed}")

    async def load_disk(self, root: str, version: int) -> None:
        _, state = await asyncio.to_thread(DiskStore(root).read, version)
        await self.update_weights(state, version)

    async def state(self) -> dict[str, torch.Tensor]:
        """This replica's weights (host copies), to give a restarted peer the current version."""
        return {k: v.detach().to("cpu") for k, v in self.engine.model.state_dict().items()}

    async def weights_hash(self, names: list[str] | None = None) -> str:
        return weights_hash(self.engine.model.state_dict(), names)

    async def memory(self) -> dict[str, int]:
        """Resident memory now and at its peak, the KV cache's bytes and, on CUDA, the bytes torch
        has allocated on the device."""
        device = next(self.engine.model.parameters()).device
        cuda = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        kv = int(self.engine.kv_stats()["kv_bytes"])
        return {"rss": rss(), "peak": peak_rss(), "kv": kv, "cuda": cuda}

    async def reset_memory_peak(self) -> None:
        reset_peak_rss()

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        await super().update_weights(state, version)
