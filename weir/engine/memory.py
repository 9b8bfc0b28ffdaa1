"""Giving an engine's memory back: weights parked in host memory while the engine sleeps.

In a colocated run the engine and the trainer take turns on one device. While the trainer trains, a
sleeping engine holds no KV cache and, when it has its own copy of the model (not the trainer's
module), need not hold its weights either: `offload_parameters` copies them to host memory (pinned
on CUDA, so the copy back is fast) and leaves every parameter an empty tensor on its device;
`OffloadedWeights.restore` puts the exact same values back into the same parameter objects.
"""

from __future__ import annotations

import torch

__all__ = ["OffloadedWeights", "offload_parameters", "return_cached_memory"]


class OffloadedWeights:
    """Host copies of a module's parameters, restored in place by `restore`."""

    def __init__(self, saved: list[tuple[torch.nn.Parameter, torch.Tensor, torch.device]]):
        self._saved = saved

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t, _ in self._saved)

    @torch.no_grad()
    def restore(self) -> None:
        for param, host, device in self._saved:
            param.data = host.to(device, non_blocking=False)
        self._saved = []


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


def return_cached_memory(device: torch.device) -> None:
    """Hand the memory torch's CUDA allocator keeps cached back to the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
