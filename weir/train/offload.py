"""A colocated trainer gives its device memory back while the engines generate.

Between training steps the trainer needs nothing on the GPU: its sharded parameters, the reference
model's shards and the optimizer state (gradients are freed by `zero_grad(set_to_none=True)`) move
to host memory, and come back before the next step. FSDP2 modules move through `module._apply`,
as `module.to(device)` moves them (FSDP2 re-registers its sharded parameters, keeping the Parameter
objects the optimizer holds); the optimizer state tensors are moved one by one. Values are
unchanged by the round trip (plain copies).

Per parameter that frees 4 (fp32 master) + 8 (AdamW moments) bytes / N ranks on each GPU, plus the
reference model's 4 / N.

With `pinned` the copies are issued with `non_blocking`: a copy from the GPU then lands in pinned
host memory (torch allocates it so, from its pinned-block cache), and a copy back from there runs
at the link's full speed instead of staging through pageable memory. Every host copy is complete
before anything on the host reads it, as with blocking copies: a module's tensors are waited for
one by one, because FSDP2 re-pads an unevenly sharded parameter once its unit's tensors have moved,
by a copy on the host that must not read memory a transfer is still writing; the optimizer state,
which nothing touches in between, is waited for once at the end. That re-pad copies into ordinary
memory: a parameter whose first dimension the ranks do not divide evenly rests unpinned, and moves
at pageable speed (one rank never pads).
"""

from __future__ import annotations

import torch

from weir.config.devices import release_cached_memory


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _state_tensors(optimizer: torch.optim.Optimizer):
    """(state dict, key, tensor) for every tensor of `optimizer.state` that moves (not the 0-d
    step counters)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                yield state, key, value


def host_bytes(
    modules: list[torch.nn.Module | None], optimizer: torch.optim.Optimizer | None
) -> dict[str, int]:
    """Bytes of `modules`' parameters and `optimizer`'s state now in host memory, and how many of
    them are pinned (what a colocated rank's offload left there)."""
    tensors = [p for m in modules if m is not None for p in m.parameters()]
    if optimizer is not None:
        tensors += [value for _, _, value in _state_tensors(optimizer)]
    host = [t for t in tensors if t.device.type == "cpu"]
    return {
        "host": sum(_nbytes(t) for t in host),
        "pinned": sum(_nbytes(t) for t in host if _local(t).is_pinned()),
    }


@torch.no_grad()
def move_optimizer_state(
    optimizer: torch.optim.Optimizer, device: torch.device, *, non_blocking: bool = False
) -> int:
    """Move every tensor of `optimizer.state` to `device`; returns the bytes moved. With
    `non_blocking` the copies may still run when it returns: synchronise before reading them on
    the host."""
    moved = 0
    for state, key, value in list(_state_tensors(optimizer)):
        if value.device != device:
            state[key] = value.to(device, non_blocking=non_blocking)
            moved += _nbytes(value)
    return moved


class StateMover:
    """Moves an optimizer's state between the device and pinned host memory on a CUDA stream of
    its own, so that the copies overlap the step's compute instead of preceding or following it:

    - `to_device` (before a step) issues the copies and returns; the optimizer's next `step`
      makes the compute stream wait for them first (a step pre-hook): the forward and backward,
      which do not read the state, run meanwhile;
    - `to_host` (after a step) issues the copies back once the step's work is done, and returns;
      the weight sync runs meanwhile, and `wait` (or any `move_trainer` with `pinned`, which
      synchronises the device) completes them before host memory is read or the device's memory
      is handed to the engine.

    Each device tensor is recorded on the stream that uses it last, so the caching allocator
    reuses its memory only after that stream's work. Without CUDA (or without pinned memory,
    whose copies wait anyway) it moves the state at once, as `move_optimizer_state` does."""

    def __init__(self, device: torch.device, *, pinned: bool) -> None:
        cuda = device.type == "cuda" and pinned and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device) if cuda else None
        self._hook = None

    def to_device(self, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
        """Issue the moves of the state to `device`; returns the bytes moved."""
        if self.stream is None:
            return move_optimizer_state(optimizer, device)
        main = torch.cuda.current_stream(device)
        self.stream.wait_stream(main)
        moved = 0
        with torch.cuda.stream(self.stream):
            for state, key, value in list(_state_tensors(optimizer)):
                if value.device != device:
                    new = value.to(device, non_blocking=True)
                    _local(new).record_stream(main)  # the optimizer reads it on `main`
                    state[key] = new
                    moved += _nbytes(value)
        self._remove_hook()
        self._hook = optimizer.register_step_pre_hook(self._before_step)
        return moved

    def to_host(self, optimizer: torch.optim.Optimizer) -> int:
        """Issue the moves of the state to pinned host memory, after the work queued so far;
        returns the bytes moved (complete after `wait`)."""
        if self.stream is None:
            return move_optimizer_state(optimizer, torch.device("cpu"))
        self._remove_hook()
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        moved = 0
        with torch.cuda.stream(self.stream):
            for state, key, value in list(_state_tensors(optimizer)):
                if value.device.type != "cpu":
                    _local(value).record_stream(self.stream)  # read by the copy on this stream
                    state[key] = value.to("cpu", non_blocking=True)
                    moved += _nbytes(value)
        return moved

    def wait(self) -> None:
        """Block until every move issued so far is complete."""
        if self.stream is not None:
            self.stream.synchronize()
        self._remove_hook()

    def _before_step(self, optimizer, args, kwargs) -> None:
        assert self.stream is not None
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self._remove_hook()

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _mover(device: torch.device, non_blocking: bool):
    """The per-tensor function of `module.to(device, non_blocking=...)`, except that a copy to the
    host has landed when it returns (module docstring)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        out = t.to(device, non_blocking=non_blocking)
        if non_blocking and out is not t and t.is_cuda and device.type == "cpu":
            torch.cuda.current_stream(t.device).synchronize()
        return out

    return move


@torch.no_grad()
def move_trainer(
    modules: list[torch.nn.Module | None],
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    *,
    pinned: bool = False,
) -> int:
    """Move `modules` (model, reference; None skipped), their gradients and `optimizer`'s state to
    `device`; returns the bytes moved. `pinned`: host copies in pinned memory (module docstring).
    On CUDA the caching allocator's free blocks are returned to the device afterwards, so another
    process (the engine) can use them."""
    non_blocking = pinned and torch.cuda.is_available()
    moved = 0
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            if p.device != device:
                moved += _nbytes(p)
        module._apply(_mover(device, non_blocking))  # what module.to(device) runs
    if optimizer is not None:
        moved += move_optimizer_state(optimizer, device, non_blocking=non_blocking)
    if non_blocking:
        torch.cuda.synchronize()
    if device.type == "cpu" and torch.cuda.is_available():
        release_cached_memory(torch.device("cuda", torch.cuda.current_device()))
    return moved
