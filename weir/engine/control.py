"""Control of the torch engine between decode steps: weight updates, pause, drain, abort.

Part of `weir.engine.torch_engine.TorchEngine` (a mixin: the methods use the engine's state). A
control operation takes the step lock (`_exclusive`), so it runs between two loop iterations; the
loop yields to it before its next one. None may be called from the engine thread itself (a
concurrent future's done-callback).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["Control"]


class Control:
    """The between-steps half of `TorchEngine` (see the module docstring)."""

    def update_weights_sync(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Between decode steps: copy `named_tensors` into the model in place, then set `version`.

        Names are the model's ``named_parameters()`` / ``named_buffers()`` names. A tensor that is the
        model's own parameter (colocated trainer) is not copied. An unknown name or a shape mismatch
        raises and leaves the version unchanged (tensors already copied stay copied).
        """
        with self._exclusive(), torch.no_grad():
            if self._offloaded is not None:
                raise RuntimeError(
                    "update_weights: the engine sleeps with its weights offloaded; wake it first"
                )
            written: set[int] = set()  # after a lazy wake: what needs no copy from the host
            try:
                for name, tensor in named_tensors:
                    dst = self._params.get(name)
                    if dst is None:
                        raise KeyError(
                            f"update_weights: the model has no parameter or buffer {name!r}"
                        )
                    if tensor is dst or (
                        tensor.data_ptr() == dst.data_ptr()
                        and tensor.shape == dst.shape
                        and tensor.dtype == dst.dtype
                    ):
                        continue
                    if tensor.shape != dst.shape:
                        raise ValueError(
                            f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                            f"the model's is {tuple(dst.shape)}"
                        )
                    dst.copy_(tensor)
                    written.add(id(dst))
                self._set_version(version)
            finally:
                self._weights_in_place(frozenset(written))
                # The weights may have changed even when nothing was copied (colocated trainer).
                self._stale_kv = self._stale_kv or self._recompute_kv_on_update
                self._drop_prefixes()

    def pause_sync(self) -> None:
        """Stop the loop between decode steps; requests in flight keep their state. Returns once
        no step is running; requests submitted meanwhile wait."""
        self._check_not_engine_thread()
        with self._mu:
            self._paused = True
        with self._step_lock:  # wait for the iteration in progress to end
            pass

    def resume_sync(self) -> None:
        """Continue decoding after `pause_sync`, and admitting after `drain_sync`."""
        with self._mu:
            self._paused = self._holding = False
            self._cond.notify_all()

    def drain_sync(self, timeout: float | None = None) -> bool:
        """Let the requests running now finish, admitting none of those waiting; return True once
        none runs, False if `timeout` seconds pass first (the rest keep decoding). Requests
        submitted meanwhile wait for `resume_sync`.

        A weight update made between a drain that returned True and `resume_sync` reaches no
        response in flight: every response is sampled under one weight version
        (``loop.on_weight_update=finish``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._check_not_engine_thread()
        with self._mu:
            if self._paused or self._asleep:
                raise RuntimeError("drain: the engine is paused or asleep; resume or wake it first")
            self._holding = True
            self._interrupts += 1  # the loop yields before its next iteration: the lock is ours
        try:  # an iteration in progress may still admit: let it end
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._step_lock.acquire(timeout=-1 if left is None else left):
                self._step_lock.release()
            else:
                return False
        finally:
            with self._mu:
                self._interrupts -= 1
                self._cond.notify_all()
        with self._mu:
            while self._batch.n and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def abort_sync(self) -> None:
        """End every request in flight or waiting now: finish_reason "abort", the tokens so far kept."""
        with self._exclusive():
            self._abort_all()

    def _check_not_engine_thread(self) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                "TorchEngine control methods cannot be called from the engine thread (e.g. from a "
                "future's done-callback); call them from another thread or from asyncio code"
            )

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the step lock between two iterations (the loop yields to us before its next one)."""
        self._check_not_engine_thread()
        with self._mu:
            self._interrupts += 1
        try:
            with self._step_lock, torch.inference_mode(False):
                yield
        finally:
            with self._mu:
                self._interrupts -= 1
                self._cond.notify_all()

    def _set_version(self, version: int) -> None:
        version = int(version)
        if version == self.version:
            return
        self.version = version
        b = self._batch
        if b.n:
            for changes, ngen in zip(b.vchanges, b.ngen.tolist(), strict=True):
                changes.append((ngen, version))

    def _abort_all(self) -> None:
        with self._mu:
            pending = list(self._pending)
            self._pending.clear()
        for req in pending:
            req.abort_unfinished()
        b = self._batch
        if b.n:
            rows = list(range(b.n))
            self._complete(b, rows, ["abort"] * len(rows))
        self._batch = self._new_batch()
        self._drop_prefixes()
