"""Giving an engine's memory back: weights parked in host memory while the engine sleeps.

In a colocated run the engine and the trainer take turns on one device. While the trainer trains, a
sleeping engine holds no KV cache and, when it has its own copy of the model (not the trainer's
module), need not hold its weights either: `offload_parameters` copies them to host memory (pinned
on CUDA, so the copy back is fast) and leaves every parameter an empty tensor on its device;
`OffloadedWeights.restore` puts the exact same values back into the same parameter objects.
"""

from __future__ import annotations

import asyncio

import torch

from weir.config.devices import release_cached_memory

__all__ = ["EngineMemory", "OffloadedWeights", "offload_parameters"]


class OffloadedWeights:
    """Host copies of a module's parameters, restored in place by `restore`; `allocate` first gives
    the parameters their device storage without the values, for a weight update to write."""

    def __init__(self, saved: list[tuple[torch.nn.Parameter, torch.Tensor, torch.device]]):
        self._saved = saved
        self._allocated = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t, _ in self._saved)

    @torch.no_grad()
    def allocate(self) -> None:
        """Every parameter gets fresh, uninitialised storage of its shape on its device; its values
        stay in host memory until `restore`."""
        for param, host, device in self._saved:
            param.data = torch.empty(host.shape, dtype=host.dtype, device=device)
        self._allocated = True

    @torch.no_grad()
    def restore(self, skip: frozenset[int] = frozenset()) -> int:
        """Put the host values back, except into the parameters whose `id` is in `skip` (written
        since `allocate`); returns the bytes copied."""
        copied = 0
        for param, host, device in self._saved:
            if id(param) in skip:
                continue
            if self._allocated:
                param.data.copy_(host)
            else:
                param.data = host.to(device, non_blocking=False)
            copied += host.numel() * host.element_size()
        self._saved = []
        return copied


@torch.no_grad()
def offload_parameters(module: torch.nn.Module) -> OffloadedWeights:
    """Move `module`'s parameters to host memory; each parameter keeps its identity (tied weights stay
    tied) and becomes an empty tensor on its device until `restore`."""
    saved = []
    for param in module.parameters():  # each shared parameter once
        device = param.device
        host = torch.empty(param.shape, dtype=param.dtype, pin_memory=device.type == "cuda").copy_(
            param.data
        )
        saved.append((param, host, device))
        param.data = torch.empty(0, dtype=param.dtype, device=device)
    return OffloadedWeights(saved)


class EngineMemory:
    """The memory part of `weir.engine.torch_engine.TorchEngine` (a mixin: the methods use the
    engine's state): what its KV cache and prefix cache hold, and sleep / wake."""

    def prefix_stats(self) -> dict[str, float]:
        """Cross-turn KV reuse: entries stored, hits and misses of ``keep_kv`` lookups, prompt tokens
        whose KV was reused instead of prefilled, entries evicted, entries and bytes held now."""
        pc = self._prefix
        if pc is None:
            return {}
        out = {f"prefix_{k}": float(v) for k, v in pc.stats.items()}
        out["prefix_entries"] = float(len(pc))
        out["prefix_bytes"] = float(pc.nbytes)
        return out

    def kv_stats(self) -> dict[str, float]:
        """KV cache memory: bytes alive now and at most so far (the engine's own tensors), the budget
        (0: none), slab reallocations, in-place moves, the live KV bytes those two copied, and
        releases (idle, sleep)."""
        kv = self._kv
        return {
            "kv_bytes": float(kv.meter.live),
            "kv_peak_bytes": float(kv.meter.peak),
            "kv_budget_bytes": float(kv.budget or 0),
            "kv_reallocs": float(kv.reallocs),
            "kv_moves": float(kv.moves),
            "kv_copied_bytes": float(kv.copied_bytes),
            "kv_releases": float(kv.releases),
            "asleep": float(self._asleep),
        }

    def sleep_sync(self, offload_weights: bool = False) -> None:
        """Give the engine's memory back until `wake_sync`: the KV cache and the decode graphs are
        freed (requests in flight keep their tokens; their KV is rebuilt when the engine wakes, the
        graphs are captured again at the next decode step) and, with `offload_weights`,
        the model's parameters move to host memory. Only offload a model the engine owns, never a
        trainer's module it shares. Requests submitted meanwhile wait. Idempotent."""
        with self._exclusive():
            if self._asleep:
                return
            self._weights_in_place()
            with self._mu:
                self._asleep = True
            if self._batch.n:
                self._stale_kv = True
            if offload_weights:
                self._offloaded = offload_parameters(self.model)
            self._release_memory(workspaces=True)

    def _release_memory(self, *, workspaces: bool = False) -> None:
        """Drop the KV slabs, the prefix cache and the decode graphs (they point at the slabs, and
        their memory pool holds each row bucket's intermediates), and hand the cached memory back
        to the device; with `workspaces`, cuBLAS's too (`release_cached_memory`: only when
        nothing else of this process computes, as when the engine sleeps for the trainer)."""
        self._batch.release_cache()
        self._drop_prefixes()
        if self._static is not None:
            self._static.reset()
        release_cached_memory(self._device, workspaces=workspaces)

    def wake_sync(self, update_follows: bool = False) -> None:
        """Undo `sleep_sync`: weights back in place (the same values), decoding resumes.

        With `update_follows` (a weight update comes next, as after each training step) offloaded
        weights are not copied back now: the parameters get their device storage, the update
        writes it, and what it did not write is copied from host memory at its end. Before that,
        the next decode step, a sleep, `weights_ready` or closing copy back whatever is not
        written yet, so nothing computes on or hands out a parameter without its values; only
        code reading the module's parameters directly in between would see them unset."""
        with self._exclusive():
            if self._offloaded is not None:
                if update_follows:
                    self._offloaded.allocate()
                    self._arriving = self._offloaded
                else:
                    self._stats["wake_restored_bytes"] += self._offloaded.restore()
                self._offloaded = None
            with self._mu:
                self._asleep = False

    def weights_ready(self) -> None:
        """Make sure every parameter holds its values (see `wake_sync(update_follows=True)`)."""
        with self._exclusive():
            self._weights_in_place()

    def _weights_in_place(self, written: frozenset[int] = frozenset()) -> None:
        """Copy back what a lazy wake left in host memory, but the parameters in `written` (by
        `id`); the caller holds the step lock."""
        if self._arriving is not None:
            arriving, self._arriving = self._arriving, None
            with torch.inference_mode(False):
                self._stats["wake_restored_bytes"] += arriving.restore(written)

    async def sleep(self, offload_weights: bool = False) -> None:
        await asyncio.to_thread(self.sleep_sync, offload_weights)

    async def wake(self, update_follows: bool = False) -> None:
        await asyncio.to_thread(self.wake_sync, update_follows)
