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
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from weir.engine.ray_engine import EngineWorker
from weir.sync.broadcast import BroadcastGroup, TensorMeta
from weir.sync.disk import DiskStore
from weir.sync.handles import Handle, open_handle, share
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
from weir.train.offload import host_bytes, move_trainer

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
    _groups: dict[str, BroadcastGroup] | None = None  # rank 0: the broadcast group of each policy

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
        self.onload()
        try:
            return super().train(batch)
        finally:
            self.offload(keep_params=True)

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

    def offload(self, *, keep_params: bool = False) -> int:
        """Colocated on a GPU: move the parameter shards (unless `keep_params`: the policies'), the
        references' and the optimizer state to host memory, and free the gradients (the next step
        zeroes them before its backward, so moving them would copy dead values both ways). A
        weight sync works either way: it moves each offloaded shard to the device as it gathers
        it. Returns the bytes moved; 0 when not colocated or on the CPU."""
        if not self._offloads or not self.policies:
            return 0
        pinned = self.settings.cluster.offload_pinned
        moved = 0
        policies = {id(a.model) for a in self.policies.values()}
        for modules, optimizer in self._movables():
            optimizer.zero_grad(set_to_none=True)
            if keep_params:
                modules = [m for m in modules if m is None or id(m) not in policies]
            moved += move_trainer(modules, optimizer, torch.device("cpu"), pinned=pinned)
        return moved

    def onload(self) -> int:
        """Undo `offload` (before training); returns the bytes moved."""
        if not self._offloads or not self.policies:
            return 0
        pinned = self.settings.cluster.offload_pinned
        device = torch.device(self.device)
        return sum(
            move_trainer(modules, optimizer, device, pinned=pinned)
            for modules, optimizer in self._movables()
        )

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
        """What the engines of `role` load, by name, as this rank's shards (DTensors; no gather),
        tied tensors once: the policy's weights, or a LoRA policy's merged ones (`Derived`)."""
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
    ) -> int:
        """Collective over the trainer ranks: gather bucket after bucket from the shards; rank 0
        broadcasts each to its group and hands it to the engine actors in `shared` (same device) by
        memory handle, waiting until they copied it. Returns the bytes rank 0 delivered. Offloads
        the parameters `train` left on the device for it, also on error."""
        root = self.rank == 0
        sent = 0
        error: Exception | None = None
        try:
            flats = gather_buckets(
                self._sharded(role),
                buckets,
                torch.device(self.device),
                root=root,
                shareable=root and bool(shared),
            )
            for bucket, flat in zip(buckets, flats, strict=True):
                if flat is None or error is not None:
                    continue  # after a failed send rank 0 still takes part in the gathers
                try:
                    self._deliver(flat, bucket, shared, version, role)
                except Exception as err:  # an engine died: the driver retries with the live ones
                    error = err
                sent += flat.numel() * flat.element_size()
                del flat
        finally:
            self.offload()
        if error is not None:
            raise RuntimeError(f"weight sync: delivery failed ({error})")
        return sent

    def _deliver(
        self,
        flat: torch.Tensor,
        bucket: list[TensorMeta],
        shared: list[Any],
        version: int,
        role: str = "",
    ) -> None:
        """One bucket to `role`'s broadcast group and, by memory handle, to the engines in
        `shared`."""
        import ray

        group = (self._groups or {}).get(role)
        if group is not None:
            group.send_flat(flat, bucket)
        if shared:
            if flat.is_cuda:
                torch.cuda.current_stream(flat.device).synchronize()
            handle = share(flat)
            refs = [e.put_shared.remote(handle, version) for e in shared]
            ray.get(refs, timeout=HANDLE_TIMEOUT_S)

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


class _Inbox:
    """Buckets handed to an engine by memory handle, consumed by one weight update."""

    def __init__(self) -> None:
        self.items: queue.Queue[tuple[Handle, threading.Event]] = queue.Queue()
        self.failed: BaseException | None = None

    def stream(
        self, buckets: list[list[TensorMeta]], device: torch.device
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in buckets:
            try:
                handle, done = self.items.get(timeout=HANDLE_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(
                    "no bucket from trainer rank 0 within the handle timeout"
                ) from None
            flat = open_handle(handle, device)
            for m, part in zip(bucket, flat.split([m.numel for m in bucket]), strict=True):
                yield m.name, part.view(m.shape)
            if flat.is_cuda:  # the copies must be done before rank 0 reuses the memory
                torch.cuda.current_stream(flat.device).synchronize()
            del flat, part
            done.set()


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
            while not inbox.items.empty():  # release a sender waiting on a bucket never read
                inbox.items.get_nowait()[1].set()

    async def put_shared(self, handle: Handle, version: int) -> None:
        """Rank 0: here is the next bucket of `version`; returns once it is copied into the model
        (or the update failed)."""
        inbox = self._inbox(version)
        if inbox.failed is not None:
            raise RuntimeError(f"the engine failed to load version {version}: {inbox.failed}")
        done = threading.Event()
        inbox.items.put((handle, done))
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
