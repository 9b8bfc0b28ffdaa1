"""Rank 0's hand-off of weight buckets by memory handle to engines on its own device / host.

Rank 0 fills two shareable staging buffers in turn (`Staging`) and hands each bucket over by the
buffer's handle (weir.sync.handles); an engine maps each buffer once per sync and copies the bucket
out of it (`Inbox`) while rank 0 fills the other buffer. A bucket may arrive before the engine has
copied the last, so buckets carry their index.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from weir.sync.broadcast import TensorMeta
from weir.sync.handles import Handle, alloc_shareable, open_handle, share

HANDLE_TIMEOUT_S = 600.0


class Staging:
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


class Inbox:
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
