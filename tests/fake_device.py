"""A CPU-backed stand-in for an accelerator, to test device placement on a machine without one.

`FakeDevice` is a dispatch mode under which tensors can live "on" another device (the meta device
by default) while their numbers are real CPU tensors: factory calls and `.to()` aimed at that device
make `OnDevice` tensors, every operation on them computes on the wrapped CPU data, and an operation
that meets an `OnDevice` tensor and an ordinary CPU tensor (other than a 0-d scalar or a copy)
raises, as CUDA does. A training step or an engine forward run under it with the model moved there
(`move_module`) fails on any tensor its code leaves on the CPU; the check is in the dispatcher, so
no code path can step around it.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# cross-device copies are legal on a real accelerator too
_COPIES = {"aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize"}

_INDEXING = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}


class DeviceMismatch(RuntimeError):
    pass


class OnDevice(torch.Tensor):
    """A CPU tensor (`elem`) that reports `device` as its device."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device) -> OnDevice:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=device,
            requires_grad=elem.requires_grad,
        )
        r.elem = elem
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        mode = FakeDevice.active
        if mode is None:
            raise DeviceMismatch(f"{func}: an OnDevice tensor used outside FakeDevice")
        return mode.run(func, args, kwargs or {})

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r}, device={self.device})"


class _NewFromData(TorchFunctionMode):
    """`torch.tensor(data, device=...)` builds its tensor below the dispatcher: build it on the CPU
    and move it with `.to()`, which the dispatch mode sees."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        ours = dev is not None and torch.device(dev).type == self.device.type
        if func in (torch.tensor, torch.as_tensor) and ours:
            return func(*args, **{**kwargs, "device": "cpu"}).to(self.device)
        if func is torch.Tensor.new_tensor and isinstance(args[0], OnDevice) and dev is None:
            return args[0].elem.new_tensor(*args[1:], **kwargs).to(self.device)
        if func is torch.Tensor.tolist and isinstance(args[0], OnDevice):
            return args[0].elem.tolist()  # a device-to-host copy, legal anywhere
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(
            args[1], list
        ):  # a list index becomes a CPU index tensor, as it may on an accelerator
            args = (args[0], torch.tensor(args[1], dtype=torch.long), *args[2:])
        return func(*args, **kwargs)


class FakeDevice(TorchDispatchMode):
    """Dispatch mode making `device` (default meta) a CPU-backed device; see the module docstring."""

    active: FakeDevice | None = None

    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.ops = 0
        self.wrapped_ops = 0

    def __enter__(self):
        FakeDevice.active = self
        self._functions = _NewFromData(self.device)
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        FakeDevice.active = None
        try:
            return super().__exit__(*exc)
        finally:
            self._functions.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.run(func, args, kwargs or {})

    def _ours(self, dev) -> bool:
        return dev is not None and torch.device(dev).type == self.device.type

    def run(self, func, args, kwargs):
        self.ops += 1
        name = func._schema.name
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        ours = [t for t in tensors if isinstance(t, OnDevice)]
        indices = (
            {id(t) for t in args[1] if isinstance(t, torch.Tensor)} if name in _INDEXING else set()
        )  # CPU index tensors may index accelerator tensors
        plain = [
            t
            for t in tensors
            if not isinstance(t, OnDevice) and t.dim() > 0 and id(t) not in indices
        ]
        if any(t.device.type == self.device.type and not isinstance(t, OnDevice) for t in tensors):
            raise DeviceMismatch(f"{name}: a {self.device} tensor without data reached the harness")
        if ours and plain and name not in _COPIES:
            shapes = [(tuple(t.shape), str(t.device)) for t in tensors]
            raise DeviceMismatch(
                f"{name}: tensors on {self.device} and on the CPU in one operation: {shapes}"
            )
        target = kwargs.get("device")
        if self._ours(target):
            kwargs = {**kwargs, "device": torch.device("cpu")}
            wrap = True
        elif target is not None:  # e.g. x.to("cpu"): the result is an ordinary tensor
            wrap = False
        else:
            wrap = bool(ours)
        unwrap = lambda x: x.elem if isinstance(x, OnDevice) else x  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if not wrap:
            return out
        self.wrapped_ops += 1
        first = func._schema.arguments[0] if func._schema.arguments else None
        writes_first = (
            first is not None and first.alias_info is not None and first.alias_info.is_write
        )
        if writes_first and args and isinstance(args[0], OnDevice):
            return args[0]  # in place: the same tensor object
        if "out" in kwargs:
            return kwargs["out"]
        return tree_map(
            lambda x: OnDevice(x, self.device) if isinstance(x, torch.Tensor) else x, out
        )


def move_module(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Put every parameter and buffer of `module` on the fake `device` (tied weights stay tied)."""
    seen: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            if id(p) not in seen:
                seen[id(p)] = torch.nn.Parameter(
                    OnDevice(p.detach(), device), requires_grad=p.requires_grad
                )
            sub._parameters[name] = seen[id(p)]
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = OnDevice(b, device)
    return module
