"""A colocated trainer gives its device memory back while the engines generate.

Between training steps the trainer needs nothing on the GPU: its sharded parameters, the reference
model's shards and the optimizer state (gradients are freed by `zero_grad(set_to_none=True)`) move
to host memory, and come back before the next step. FSDP2 modules move with `module.to(device)`
(FSDP2 re-registers its sharded parameters, keeping the Parameter objects the optimizer holds); the
optimizer state tensors are moved one by one. Values are unchanged by the round trip (plain copies).

Per parameter that frees 4 (fp32 master) + 8 (AdamW moments) bytes / N ranks on each GPU, plus the
reference model's 4 / N.
"""

from __future__ import annotations

import torch

from weir.config.devices import release_cached_memory


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


@torch.no_grad()
def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Move every tensor of `optimizer.state` to `device`; returns the bytes moved."""
    moved = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device and value.dim() > 0:
                state[key] = value.to(device)
                moved += _nbytes(value)
    return moved


@torch.no_grad()
def move_trainer(
    modules: list[torch.nn.Module | None],
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
) -> int:
    """Move `modules` (model, reference; None skipped), their gradients and `optimizer`'s state to
    `device`; returns the bytes moved. On CUDA the caching allocator's free blocks are returned to
    the device afterwards, so another process (the engine) can use them."""
    moved = 0
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            if p.device != device:
                moved += _nbytes(p)
        module.to(device)
    if optimizer is not None:
        moved += move_optimizer_state(optimizer, device)
    if device.type == "cpu" and torch.cuda.is_available():
        release_cached_memory(torch.device("cuda", torch.cuda.current_device()))
    return moved
