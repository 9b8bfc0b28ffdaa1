"""Mixed precision on one process as FSDP2's `MixedPrecisionPolicy` gives ranks
(`train.mixed_precision: compute_copy`): the forward and backward run on a copy of the weights in
the compute dtype, the optimizer on the float32 masters.

Under `torch.autocast` the parameters stay float32, so the embeddings' output and the residual
stream are float32, every linear layer casts its input and its weight to bfloat16 again in every
micro-batch, and each weight gradient flows back through a cast. FSDP2 instead casts the gathered
shards once (`param_dtype=bfloat16`), computes everything in bfloat16 (the residual stream too;
the norms upcast internally as Hugging Face's do) and reduces the gradients in float32
(`reduce_dtype=float32`). `ComputeCopy` does what FSDP2 does for a rank of one:

    w_c = round_c(w)                       at each activation (one cast per parameter)
    g_w += float32(g_{w_c})                after each backward, per micro-batch
    w <- AdamW(w, g_w)                     on the float32 masters, outside the activation

While `active()`, each module's parameter slot holds the copy (a leaf that takes the gradient, in
the compute dtype; a tied weight stays one tensor); on leaving, the masters are back, so whatever
reads the model outside a step (the engine weight sync, checkpoints, an engine on the same module)
reads exactly what it reads under autocast. A copy's gradient is moved into its master's `.grad`
(float32, added) as soon as autograd has accumulated it (`register_post_accumulate_grad_hook`),
so a bfloat16 gradient lives only during its own backward; gradient accumulation over micro-batches
happens in float32, as FSDP2's does after its reduce-scatter. The copies are made afresh from the
masters at every activation (never stale after an optimizer step, a checkpoint load or a weight
reset) and dropped after it, so they cost 2 bytes per parameter only during a step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["ComputeCopy", "cast_parameters"]


def _slots(model: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """Every (module, name) that holds each distinct parameter (a tied weight holds two)."""
    slots: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, name))
    return slots


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with its floating parameters (not its buffers: RoPE's inverse frequencies stay
    float32, as FSDP2 leaves them) in `dtype`, frozen, tied weights kept tied: a frozen model (the
    KL reference, a distillation teacher) computed as a `ComputeCopy` computes, without a master."""
    for slots in _slots(model).values():
        module, name = slots[0]
        p = module._parameters[name]
        if not p.is_floating_point() or p.dtype == dtype:
            continue
        cast = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
        for module, name in slots:
            module._parameters[name] = cast
    return model.requires_grad_(False)


class ComputeCopy:
    """The compute-dtype copy of `model`'s floating parameters, swapped in by `active()`."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self._masters: list[torch.nn.Parameter] = []
        self._copies: set[int] = set()
        self._depth = 0

    def covers(self, model: object) -> bool:
        """Whether `model` runs on these parameters: the model itself, or a view of it such as a
        LoRA reference that switches the adapters off (its first parameter is ours)."""
        if model is self.model:
            return True
        params = getattr(model, "parameters", None)
        first = next(iter(params()), None) if callable(params) else None
        return first is not None and (
            id(first) in self._copies or first is next(self.model.parameters(), None)
        )

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The enclosed forwards and backwards run on fresh compute-dtype copies; their gradients
        land in the float32 masters. Re-entrant: an inner activation uses the outer's copies."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        swapped = self._swap_in()
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            self._swap_out(swapped)

    def _swap_in(self) -> list[tuple[torch.nn.Parameter, list[tuple[torch.nn.Module, str]]]]:
        swapped = []
        for slots in _slots(self.model).values():
            module, name = slots[0]
            master = module._parameters[name]
            if not master.is_floating_point() or master.dtype == self.dtype:
                continue
            copy = torch.nn.Parameter(
                master.detach().to(self.dtype), requires_grad=master.requires_grad
            )
            if master.requires_grad:
                copy.register_post_accumulate_grad_hook(_into(master))
            for module, name in slots:
                module._parameters[name] = copy
            swapped.append((master, slots))
            self._copies.add(id(copy))
        return swapped

    def _swap_out(self, swapped) -> None:
        for master, slots in swapped:
            for module, name in slots:
                module._parameters[name] = master
        self._copies.clear()


def _into(master: torch.nn.Parameter):
    """The hook that adds a copy's gradient into `master.grad` in the master's dtype and frees
    the copy's (FSDP2 with reduce_dtype=float32: cast, then accumulate)."""

    def hook(copy: torch.Tensor) -> None:
        grad, copy.grad = copy.grad, None
        if grad is None:
            return
        if master.grad is None:
            master.grad = grad.to(master.dtype)
        else:
            master.grad.add_(grad)

    return hook
