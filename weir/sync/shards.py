"""Full tensors from FSDP2 shards, one bucket at a time: the trainer side of a weight sync.

Every trainer rank holds 1/N of each parameter (a DTensor sharded on dim 0). A sync walks the
model's tensors in buckets (`plan_buckets`); for each bucket every rank takes part in the
all-gathers of its tensors, tensor by tensor, and rank 0 copies each full tensor into the bucket's
flat buffer (cast to the engines' dtype) and drops the full tensor before gathering the next. The
buffer is sent and freed before the next bucket starts, so a rank never holds more than its shards,
one bucket and one full tensor:

    peak(rank 0) ~ model_bytes / N + bucket_bytes + largest_tensor_bytes

where the old path (`get_model_state_dict(full_state_dict=True)`) held the whole model. On GPUs the
gathers run on the device (NCCL), so nothing passes through host memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from weir.sync.broadcast import TensorMeta
from weir.sync.handles import alloc_shareable


@dataclass(frozen=True)
class Derived:
    """A full tensor an engine gets that the trainer holds as other tensors, computed when its
    bucket is gathered: e.g. a LoRA layer's merged weight W + s B A from the shards of W, A and B
    (weir.train.sharded_lora). `compute(device)` is collective (every rank calls it) and returns
    the full tensor in `dtype` on `device`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    compute: Callable[[torch.device], torch.Tensor]

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


def unique_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the second name of a tied tensor (an engine of the same class has the same
    ties, so loading one name loads both). A model's state dict gives each name a tensor object of
    its own, so a tie is told by the memory the two hold (this rank's shard of a DTensor); a rank
    whose shard is empty keeps both names, which costs nothing since only rank 0's names are sent.
    A `Derived` tensor (a LoRA layer's merged weight) holds no memory: it is told by its object."""
    seen: set[object] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        key: object = id(t)
        local = t.to_local() if isinstance(t, DTensor) else t
        if isinstance(local, torch.Tensor) and local.numel():
            where = (local.untyped_storage().data_ptr(), local.storage_offset(), local.stride())
            key = (*where, t.shape, t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def wire_metas(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> list[TensorMeta]:
    """The full (global) shape of each tensor, in `dtype` when given (floating tensors only),
    without gathering anything."""
    metas = []
    for name, t in state.items():
        wire = dtype if dtype is not None and t.is_floating_point() else t.dtype
        metas.append(TensorMeta(name, tuple(t.shape), str(wire).removeprefix("torch.")))
    return metas


def full_tensor(
    t: torch.Tensor | Derived, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Collective for a DTensor (and a `Derived` tensor): the whole tensor on `device` (every rank
    gets it), in `dtype` when given (a floating tensor is cast before the all-gather, so a bfloat16
    sync moves half the
    bytes of the float32 masters). A shard kept in host memory (FSDP2 CPU offload) is moved to
    `device` first, since NCCL gathers on the GPU. A plain tensor (a buffer FSDP2 does not shard)
    is the same on every rank: no collective."""
    cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
    if isinstance(t, Derived):
        return t.compute(device).to(cast)
    if not isinstance(t, DTensor):
        return t.detach().to(device, cast)
    local = t.to_local().detach()
    if t.device_mesh.size() == 1 and local.shape == t.shape:  # one rank holds all of it
        return local.to(device, cast)
    if local.device != device or local.dtype != cast:
        t = DTensor.from_local(
            local.to(device, cast), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
        )
    return t.detach().full_tensor()


def gather_buckets(
    state: Mapping[str, torch.Tensor],
    buckets: list[list[TensorMeta]],
    device: torch.device,
    *,
    root: bool,
    shareable: bool = False,
    into: Callable[[int, torch.dtype], torch.Tensor] | None = None,
) -> Iterator[torch.Tensor | None]:
    """Collective: yields each bucket's flat buffer (its tensors in order, cast to their meta
    dtype) on the `root` rank, None on the others.

    The caller sends the buffer and lets go of it before asking for the next. `into(numel, dtype)`
    gives the buffer to fill (a staging buffer the caller reuses); otherwise with `shareable` it is
    allocated for `weir.sync.handles.share` (device memory on CUDA, a shared-memory segment on the
    CPU), else a bucket of one tensor goes as the gathered tensor itself.
    """
    for bucket in buckets:
        if not root:
            for m in bucket:
                full_tensor(state[m.name], device, m.torch_dtype)
            yield None
            continue
        dtype = bucket[0].torch_dtype
        if len(bucket) == 1 and not shareable and into is None:
            yield full_tensor(state[bucket[0].name], device, dtype).reshape(-1)
            continue
        numel = sum(m.numel for m in bucket)
        if into is not None:
            flat = into(numel, dtype)
        elif shareable:
            flat = alloc_shareable(numel, dtype, device)
        else:
            flat = torch.empty(numel, dtype=dtype, device=device)
        offset = 0
        for m in bucket:
            full = full_tensor(state[m.name], device, dtype)
            flat[offset : offset + m.numel].copy_(full.reshape(-1))
            offset += m.numel
            del full
        yield flat
        del flat


def sharded_hash(
    state: Mapping[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype | None = None,
    names: list[str] | None = None,
) -> str:
    """Collective: `weir.sync.weights_hash` of the full tensors (cast to `dtype`, floating ones),
    computed one gathered tensor at a time. Every rank returns the hash."""
    h = hashlib.sha256()
    for name in sorted(state if names is None else names):
        t = full_tensor(state[name], device, dtype).to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def sharded_digest(
    state: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype | None = None
) -> str:
    """Collective: `weir.sync.hashing.combine_digests` of the full tensors of `state` (floating
    ones cast to `dtype`), gathered one tensor at a time: what an engine that loaded them reports."""
    from weir.sync.hashing import combine_digests, tensor_digest

    return combine_digests(
        {name: tensor_digest(name, full_tensor(t, device, dtype)) for name, t in state.items()}
    )
