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
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from weir.engine.ray_engine import EngineWorker
from weir.sync.broadcast import BroadcastGroup, TensorMeta
from weir.sync.disk import DiskStore
from weir.sync.handles import Handle
from weir.sync.handoff import HANDLE_TIMEOUT_S, Inbox, Staging
from weir.sync.hashing import weights_hash
from weir.sync.host_memory import peak_rss, reset_peak_rss, rss
from weir.sync.shards import (
    full_tensor,
    gather_buckets,
    sharded_digest,
    sharded_hash,
    unique_tensors,
    wire_metas,
)
from weir.train.batch import TrainBatch
from weir.train.distributed import TrainerRank, free_port
from weir.train.offload import StateMover, host_bytes, move_trainer


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
    _groups: dict[str, BroadcastGroup] | None = None  # rank 0: the broadcast group of each policy
    _movers: dict[int, StateMover] | None = None  # by id of the optimizer whose state it moves

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

    def _movables(self) -> list[tuple[list[torch.nn.Module], Any]]:
        """(modules, optimizer) of every model this rank holds: each policy with its reference,
        each critic."""
        out = []
        for role, a in self.policies.items():
            ref = a.ref if isinstance(a.ref, torch.nn.Module) else None  # LoRA: adapters off
            out.append(([a.model, ref], a.optimizer))
            if role in self.critics:
                c = self.critics[role]
                out.append(([c.model], c.optimizer))
        return out

    def _state_mover(self, optimizer: Any) -> StateMover:
        """The `StateMover` of one optimizer (each keeps its own stream and step hook)."""
        self._movers = self._movers if self._movers is not None else {}
        key = id(optimizer)
        if key not in self._movers:
            pinned = self.settings.cluster.offload_pinned
            self._movers[key] = StateMover(torch.device(self.device), pinned=pinned)
        return self._movers[key]

    def offload(self, *, keep_params: bool = False) -> int:
        """Colocated on a GPU: move the parameter shards (unless `keep_params`: the policies'), the
        references' and the optimizer state to host memory, and free the gradients (the next step
        zeroes them before its backward, so moving them would copy dead values both ways). A
        weight sync works either way: it moves each offloaded shard to the device as it gathers
        it. Returns the bytes moved; 0 when not colocated or on the CPU.

        After a step (`keep_params`) the optimizer states leave on streams of their own
        (`StateMover`) while the weight sync that follows runs; the sync's own offload (without
        `keep_params`) completes them."""
        if not self._offloads or not self.policies:
            return 0
        pinned = self.settings.cluster.offload_pinned
        host = torch.device("cpu")
        movables = self._movables()
        for _, optimizer in movables:
            optimizer.zero_grad(set_to_none=True)
        moved = 0
        if keep_params:  # the references (and critics) leave now, then the states on their streams
            policies = {id(a.model) for a in self.policies.values()}
            for modules, _ in movables:
                rest = [m for m in modules if m is None or id(m) not in policies]
                moved += move_trainer(rest, None, host, pinned=pinned)
            for _, optimizer in movables:
                moved += self._state_mover(optimizer).to_host(optimizer)
            return moved
        for modules, optimizer in movables:
            self._state_mover(optimizer).wait()
            moved += move_trainer(modules, optimizer, host, pinned=pinned)
        return moved

    def onload(self, *, overlap_state: bool = False) -> int:
        """Undo `offload`; returns the bytes moved. With `overlap_state` (before a step) the
        optimizer states come on streams of their own while the forward and backward run, and
        each optimizer's step waits for its own (`StateMover`)."""
        if not self._offloads or not self.policies:
            return 0
        pinned = self.settings.cluster.offload_pinned
        device = torch.device(self.device)
        movables = self._movables()
        for _, optimizer in movables:  # a move still in flight lands before this one starts
            self._state_mover(optimizer).wait()
        if not overlap_state:
            return sum(
                move_trainer(modules, optimizer, device, pinned=pinned)
                for modules, optimizer in movables
            )
        moved = sum(move_trainer(modules, None, device, pinned=pinned) for modules, _ in movables)
        for _, optimizer in movables:
            moved += self._state_mover(optimizer).to_device(optimizer, device)
        return moved

    def device_memory(self) -> dict[str, int]:
        """CUDA memory this process holds (allocated / reserved by torch), and the bytes of its
        parameters and optimizer state in host memory, pinned or not (`host_bytes`); device
        figures are zeros on CPU."""
        host: dict[str, int] = {}
        for modules, optimizer in self._movables():
            for k, v in host_bytes(modules, optimizer).items():
                host[k] = host.get(k, 0) + v
        if not self.device.startswith("cuda"):
            return {"allocated": 0, "reserved": 0, **host}
        return {
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
            **host,
        }

    def _sharded(self, role: str = "") -> dict[str, torch.Tensor]:
        """What the engines of `role` load, by name, as this rank's shards (DTensors; no gather;
        whole tensors on a group of one rank), tied tensors once: the policy's weights, or a LoRA
        policy's merged ones (`Derived`)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from weir.train.lora import is_lora

        model = self.policy(role).model
        if is_lora(model):
            from weir.sync.lora_wire import merged_wire_state

            return unique_tensors(merged_wire_state(model))
        return unique_tensors(get_model_state_dict(model))

    def layout(self, dtype: str | None = None, role: str = "") -> list[TensorMeta]:
        """Names and full shapes of the weights `role`'s engines load, floating tensors in `dtype`
        (the engines' dtype; None keeps the trainer's)."""
        return wire_metas(self._sharded(role), getattr(torch, dtype) if dtype else None)

    def device_key(self) -> tuple[str, str]:
        return device_key(torch.device(self.device))

    def sync_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def join(
        self,
        host: str,
        port: int,
        size: int,
        name: str,
        backend: str,
        style: str = "weir",
        per_tensor: bool = False,
        role: str = "",
    ) -> None:
        """Rank 0: become the root of a new weight-broadcast group (`BroadcastGroup`) of `size`
        members, the engines of `role`'s policy; returns once every member joined."""
        self.leave(role)
        self._groups = self._groups or {}
        self._groups[role] = BroadcastGroup(
            host, port, 0, size, backend=backend, name=name, style=style, per_tensor=per_tensor
        )

    def leave(self, role: str = "") -> None:
        """No broadcast group for `role`'s engines (every one takes handles)."""
        old = (self._groups or {}).pop(role, None)
        if old is not None:
            old.close()

    def stream(
        self, buckets: list[list[TensorMeta]], shared: list[Any], version: int, role: str = ""
    ) -> tuple[int, float]:
        """Collective over the trainer ranks: gather bucket after bucket from the shards; rank 0
        broadcasts each to its group and hands it to the engine actors in `shared` (same device)
        by memory handle. Returns (the bytes rank 0 delivered, the seconds the offload after it
        took). Offloads the parameters `train` left on the device for it, also on error.

        The handles point into two staging buffers that the buckets take in turn (`Staging`): an
        engine opens each buffer once per sync, and rank 0 fills the next bucket while the
        engines copy the last one out of the other buffer."""
        root = self.rank == 0
        sent = 0
        error: Exception | None = None
        device = torch.device(self.device)
        staging = Staging(buckets, device) if root and shared else None
        try:
            flats = gather_buckets(
                self._sharded(role),
                buckets,
                device,
                root=root,
                into=None if staging is None else staging.take,
            )
            for bucket, flat in zip(buckets, flats, strict=True):
                if flat is None or error is not None:
                    continue  # after a failed send rank 0 still takes part in the gathers
                try:
                    self._deliver(flat, bucket, shared, version, role, staging)
                except Exception as err:  # an engine died: the driver retries with the live ones
                    error = err
                sent += flat.numel() * flat.element_size()
                del flat
                if staging is not None and staging.error is not None:
                    error = staging.error
            group = (self._groups or {}).get(role) if root else None
            if group is not None and error is None:
                try:
                    group.drain()  # the last broadcast in flight (NCCL)
                except Exception as err:
                    error = err
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
        bucket: list[TensorMeta],
        shared: list[Any],
        version: int,
        role: str = "",
        staging: Staging | None = None,
    ) -> None:
        """One bucket to `role`'s broadcast group and, by its staging buffer's memory handle, to
        the engines in `shared` (their copies are waited for before the buffer is reused)."""
        group = (self._groups or {}).get(role)
        if group is not None:
            group.send_flat(flat, bucket)
        if shared:
            assert staging is not None, "handles go through rank 0's staging buffers"
            if flat.is_cuda:  # the engines read it on their own streams: the writes land first
                torch.cuda.current_stream(flat.device).synchronize()
            refs = [e.put_shared.remote(staging.handle, version, staging.index) for e in shared]
            staging.hand_over(refs)

    def gather(self, role: str = "") -> list[TensorMeta]:
        """Collective: rank 0 keeps the full weights of `role`'s engines (host memory) until
        `release` and returns their layout; the other ranks return []. For the disk and
        object-store transports only."""
        device = torch.device(self.device)
        try:
            state = {k: full_tensor(v, device).to("cpu") for k, v in self._sharded(role).items()}
        finally:
            self.offload()
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

    def weights_hash(self, dtype: str | None = None, role: str = "") -> str:
        """Collective: `weights_hash` of the full weights as the engines get them (tied tensors
        under both names; a LoRA policy's merged), gathered one tensor at a time."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from weir.train.lora import is_lora

        model = self.policy(role).model
        if is_lora(model):
            from weir.sync.lora_wire import merged_wire_state

            state = merged_wire_state(model)
        else:
            state = get_model_state_dict(model)
        return sharded_hash(
            state, torch.device(self.device), getattr(torch, dtype) if dtype else None
        )

    def wire_hash(self, dtype: str | None = None, role: str = "") -> str:
        """Collective: `weights_hash` of what `role`'s engines load (the names that travel, each
        once), gathered one tensor at a time: what `SyncEngineWorker.weights_hash(names)` of an
        engine that holds them gives."""
        return sharded_hash(
            self._sharded(role), torch.device(self.device), getattr(torch, dtype) if dtype else None
        )

    def weights_digest(self, dtype: str | None = None, role: str = "") -> str:
        """Collective: the digest of the weights as the engines get them (tied tensors once, as
        they travel), gathered one tensor at a time (`weir.sync.shards.sharded_digest`)."""
        return sharded_digest(
            self._sharded(role), torch.device(self.device), getattr(torch, dtype) if dtype else None
        )

    def save_hf(self, out: str, bucket_mb: float, role: str = "") -> list[str]:
        """Collective: as `TrainerRank.save_hf`; a LoRA policy's weights merged (W + s B A, what the
        engines run), under the base model's names."""
        from weir.train.lora import is_lora

        model = self.policy(role).model
        if not is_lora(model):
            return self._on_device("save_hf", out, bucket_mb, role)
        from weir.sync.lora_wire import merged_wire_state
        from weir.train.meta_init import write_hf_weights

        device = torch.device(self.device)
        self.onload()
        try:
            return write_hf_weights(
                None,
                out,
                write=self.rank == 0,
                bucket_bytes=int(bucket_mb * 2**20),
                tensors=unique_tensors(merged_wire_state(model)),
                full=lambda t: full_tensor(t, device),
            )
        finally:
            self.offload()

    def write_adapter(self, out: str, role: str = "") -> int:
        """Collective: `role`'s LoRA adapter gathered and written by rank 0 as a peft adapter
        directory at `out` (weir.sync.lora_wire); returns its bytes."""
        from weir.sync.lora_wire import write_adapter

        self.onload()
        try:
            return write_adapter(
                self.policy(role).model, out, torch.device(self.device), self.rank == 0
            )
        finally:
            self.offload()

    def memory(self) -> dict[str, int]:
        """This process's resident memory now and at its peak since `reset_memory_peak` (bytes)."""
        return {"rss": rss(), "peak": peak_rss()}

    def reset_memory_peak(self) -> None:
        reset_peak_rss()


class SyncEngineWorker(EngineWorker):
    """An engine replica that receives weights by broadcast, memory handle, disk or object store."""

    _group: BroadcastGroup | None = None
    _inboxes: dict[int, Inbox] | None = None

    def _inbox(self, version: int) -> Inbox:
        if self._inboxes is None:
            self._inboxes = {}
        return self._inboxes.setdefault(version, Inbox())

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

    async def _weights_ready(self) -> None:
        """Parameters a lazy wake left unset get their values first (EngineMemory.wake_sync)."""
        ready = getattr(self.engine, "weights_ready", None)
        if ready is not None:
            await asyncio.to_thread(ready)

    async def state(self) -> dict[str, torch.Tensor]:
        """This replica's weights (host copies), to give a restarted peer the current version."""
        await self._weights_ready()
        return {k: v.detach().to("cpu") for k, v in self.engine.model.state_dict().items()}

    async def weights_hash(self, names: list[str] | None = None) -> str:
        await self._weights_ready()
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
