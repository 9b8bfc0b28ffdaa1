"""Measure the memory a piece of torch code allocates, on any device, CPU included.

`AllocationPeak` is a dispatch mode that sees every tensor an operation returns (forward and
backward): a tensor whose storage it has not seen is a new allocation of `storage.nbytes()`,
released when that storage is freed (a finalizer on the storage object, which torch keeps unique
per storage). `peak` is the largest total of live allocations made under the mode, `largest` the
largest single one. Tensors that existed before (parameters, inputs) and views of an operation's
inputs are not counted. Allocator
caching and fragmentation are not modelled: these are the bytes the code asks for.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _has_storage(t: object) -> bool:
    """A plain tensor with memory of its own: not meta, not a wrapper subclass (a DTensor's local
    tensor is dispatched, and counted, on its own)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return False
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:
        return False
    return True


class AllocationPeak(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0
        self._seen: set[int] = set()
        self._lock = threading.Lock()

    def _release(self, key: int, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes
            self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if _has_storage(t)
        }
        for t in tree_flatten(out)[0]:
            if not _has_storage(t):
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in inputs:  # a view of, or written into, an input
                continue
            key = id(storage)
            with self._lock:
                if key in self._seen:
                    continue
                self._seen.add(key)
                nbytes = storage.nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                self.largest = max(self.largest, nbytes)
            weakref.finalize(storage, self._release, key, nbytes)
        return out
