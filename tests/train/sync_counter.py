"""Count the host synchronisations a piece of trainer code would make on an accelerator.

`HostSyncs` is `tests.fake_device.FakeDevice` (the model on a CPU-backed stand-in device) that also
counts what waits for the device on CUDA: a value read back (`.item()`, `bool()`, `float()`,
`.tolist()`), a copy to the host, and a host-to-device copy of data made without `non_blocking`
(from pageable memory CUDA copies synchronously, after the work queued before it). Each is counted
under `weir` or, when it happens inside the Hugging Face model's forward, under `model` (e.g.
transformers' SDPA mask code reading whether a padding mask is all ones)."""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from tests.fake_device import FakeDevice, OnDevice


class _CountToList(TorchFunctionMode):
    def __init__(self, owner: HostSyncs) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist and isinstance(args[0], OnDevice):
            self.owner.count("tolist")
        return func(*args, **(kwargs or {}))


class HostSyncs(FakeDevice):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: dict[tuple[str, str], int] = {}
        self.where: list[tuple[str, str, list[str]]] = []

    def count(self, what: str) -> None:
        stack = traceback.extract_stack()
        where = "model" if any("/transformers/" in f.filename for f in stack) else "weir"
        self.syncs[where, what] = self.syncs.get((where, what), 0) + 1
        frames = [f"{f.filename}:{f.lineno}" for f in stack if "/weir/" in f.filename]
        self.where.append((where, what, frames[-4:]))

    def total(self, where: str = "weir") -> int:
        return sum(v for (w, _), v in self.syncs.items() if w == where)

    def clear(self) -> None:
        self.syncs.clear()
        self.where.clear()

    def __enter__(self):
        out = super().__enter__()
        self._tolist = _CountToList(self)
        self._tolist.__enter__()
        return out

    def __exit__(self, *exc):
        self._tolist.__exit__(*exc)
        return super().__exit__(*exc)

    def run(self, func, args, kwargs):
        name = func._schema.name
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if name == "aten::_local_scalar_dense" and any(isinstance(t, OnDevice) for t in flat):
            self.count("item")
        elif name == "aten::_to_copy":
            src, target = args[0], kwargs.get("device")
            to_host = target is not None and torch.device(target).type == "cpu"
            if isinstance(src, OnDevice) and to_host:
                self.count("to_host")
            elif (
                not isinstance(src, OnDevice)
                and self._ours(target)
                and not kwargs.get("non_blocking")
                and src.numel() > 0
                and src.dim() > 0
            ):
                self.count("pageable_to_device")
        return super().run(func, args, kwargs)
