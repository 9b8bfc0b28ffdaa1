"""Liger's kernels on the trainer's model only (`train.fuse=liger`, weir.train.fuse).

Liger's `apply_liger_kernel_to_<arch>(model=...)` does two things: it binds its RMSNorm and SwiGLU
forwards to the modules of `model` (instance attributes), and it replaces the transformers modeling
module's classes and functions (`Qwen2RMSNorm`, `Qwen2MLP`, `apply_rotary_pos_emb`) for the whole
process: every model of that architecture built afterwards, and every call of the RoPE function by
any model (a colocated engine's included), would run Liger's kernels, and `torch.compile` would
meet them in a model it was asked to compile (it failed inside Liger's RMSNorm that way).

`apply_liger` keeps the first and undoes the second: only the trainer's own instances run fused.
RoPE stays as transformers computes it, since Liger replaces it only as the modeling module's
function, which the attention layers of every model of the architecture call.

A copy of the trainer's model (a colocated engine's, made once the trainer is built) carries the
bound forwards along; `strip_liger` takes them off, so that the engine runs the plain modules and,
with them, its direct decode forward and CUDA graphs (weir.engine.decode runs only modules whose
forward is the class's). An engine that shares the trainer's very modules (engine.share_weights on
the trainer's device and dtype) runs them fused, through the Hugging Face forward.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

MARK = "_weir_liger"
"""Set on each module whose methods Liger bound (what `strip_liger` undoes)."""
BOUND = ("forward", "extra_repr", "_get_name")
"""The methods Liger binds to a module instance."""


def _transformers_modules() -> dict[str, dict[str, Any]]:
    """A shallow copy of the namespace of every loaded `transformers` module."""
    return {
        name: dict(vars(module))
        for name, module in list(sys.modules.items())
        if module is not None and (name == "transformers" or name.startswith("transformers."))
    }


def _restore(saved: dict[str, dict[str, Any]]) -> list[str]:
    """Put back every name of the modules in `saved` that was rebound or added since; returns the
    `module.name`s put back."""
    undone = []
    for name, before in saved.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        now = vars(module)
        for key in [k for k in now if k not in before]:
            delattr(module, key)
            undone.append(f"{name}.{key}")
        for key, value in before.items():
            if now.get(key, before) is not value:
                setattr(module, key, value)
                undone.append(f"{name}.{key}")
    return undone


def apply_liger(model: torch.nn.Module) -> list[str]:
    """Liger's RMSNorm and SwiGLU kernels on `model`'s modules, and on nothing else in the process
    (module docstring). Returns the module-level names Liger had replaced and that were put back."""
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    before = {id(m): "forward" in vars(m) for m in model.modules()}
    saved = _transformers_modules()
    try:
        _apply_liger_kernel_to_instance(
            model=model,
            rope=False,
            rms_norm=True,
            swiglu=True,
            cross_entropy=False,
            fused_linear_cross_entropy=False,
        )
    finally:
        undone = _restore(saved)
    for m in model.modules():
        if "forward" in vars(m) and not before.get(id(m), False):
            setattr(m, MARK, True)
    return undone


def strip_liger(model: torch.nn.Module) -> int:
    """Take `apply_liger`'s bound methods off the modules of `model` (a copy of a fused trainer's
    model), so that they run their class's forward again; returns how many modules were fused."""
    count = 0
    for m in model.modules():
        if vars(m).pop(MARK, False):
            for name in BOUND:
                vars(m).pop(name, None)
            count += 1
    return count
