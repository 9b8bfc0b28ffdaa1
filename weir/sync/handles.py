"""Memory handles: hand a buffer to another process on the same device without copying it.

An engine on the same GPU as trainer rank 0 cannot join an NCCL group with it (NCCL refuses two
ranks of one communicator on one device), and needs no copy through a network anyway: rank 0 sends a
CUDA IPC handle of its bucket (`torch.multiprocessing.reductions.reduce_tensor`, the mechanism
torch.multiprocessing uses) and the engine maps the same device memory into its own address space.
On the CPU the same protocol runs over POSIX shared memory: the bucket is allocated in a named
shared-memory segment and the engine maps it by name. Either way a handle is a small picklable value
that travels through Ray; the sender must keep the buffer alive until the receiver has copied it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Handle:
    """A picklable reference to a 1-D buffer of `numel` elements of `dtype` in another process."""

    kind: str  # "cuda" (CUDA IPC) or "shm" (POSIX shared memory)
    dtype: str
    numel: int
    payload: tuple[Any, ...]


def alloc_shareable(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D buffer that `share` can hand out: device memory on CUDA, a named shared-memory segment
    on the CPU (allocated there directly, so nothing is copied into it later)."""
    if device.type == "cuda":
        return torch.empty(numel, dtype=dtype, device=device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    storage = torch.UntypedStorage._new_using_filename_cpu(max(nbytes, 1))
    return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))


def share(buf: torch.Tensor) -> Handle:
    """A handle to `buf` (from `alloc_shareable`) for a process on the same GPU / host."""
    dtype = str(buf.dtype).removeprefix("torch.")
    if buf.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(buf)
        return Handle("cuda", dtype, buf.numel(), tuple(args))
    manager, name, size = buf.untyped_storage()._share_filename_cpu_()
    return Handle("shm", dtype, buf.numel(), (manager, name, size))


def open_handle(handle: Handle, device: torch.device | None = None) -> torch.Tensor:
    """The buffer behind `handle`, mapped into this process (no copy). For CUDA, `device` is this
    process's index of the same GPU (Ray gives each actor its own CUDA_VISIBLE_DEVICES numbering),
    default the current device."""
    dtype = getattr(torch, handle.dtype)
    if handle.kind == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(handle.payload)
        args[6] = torch.cuda.current_device() if device is None else device.index or 0
        return rebuild_cuda_tensor(*args)
    if handle.kind != "shm":
        raise ValueError(f"unknown memory handle kind {handle.kind!r}")
    manager, name, size = handle.payload
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, size)
    return torch.empty(0, dtype=dtype).set_(storage, 0, (handle.numel,), (1,))
