"""Where the transformers API differs across the releases weir supports (5.17 up to, not including,
5.40), one function per difference, so that the callers read the same on every release.

- The KV cache argument of a model's forward: ``past_key_values`` until 5.23, ``cache`` from 5.24
  (``past_key_values`` then still works with a FutureWarning, and goes in 5.40). 5.17-5.23 do not
  know ``cache``: a model takes it into ``**kwargs`` and runs without the cache, silently wrong, so
  the name is read off the model's own forward signature, never assumed.
- Whether activation checkpointing is on: ``is_activation_checkpointing`` where the model has it
  (5.18+), else ``is_gradient_checkpointing`` (which 5.24 deprecates).
"""

from __future__ import annotations

import inspect
from typing import Any

from packaging.version import Version

__all__ = ["cache_kwarg", "cache_kwargs", "is_checkpointing"]

_CACHE_RENAMED = Version("5.24.0")
_NAMES: dict[type, str] = {}


def _transformers_version() -> Version:
    import transformers

    return Version(transformers.__version__)


def _forward_parameters(model: Any) -> set[str]:
    """Named parameters of `model`'s forward (decorators unwrapped), looking through the wrappers
    whose own forward takes only ``*args, **kwargs`` (torch.compile, peft)."""
    for _ in range(4):
        try:
            params = inspect.signature(type(model).forward).parameters
        except (TypeError, ValueError, AttributeError):
            params = {}
        named = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if named & {"cache", "past_key_values"}:
            return named
        inner = getattr(model, "_orig_mod", None)  # torch.compile
        if inner is None and hasattr(model, "get_base_model"):  # peft
            inner = model.get_base_model()
        if inner is None or inner is model:
            return named
        model = inner
    return set()


def cache_kwarg(model: Any) -> str:
    """The name under which `model`'s forward takes its KV cache: ``"cache"`` where the forward
    declares it (transformers 5.24+), ``"past_key_values"`` where it declares only that (5.17-5.23,
    and remote-code models written for them); for a forward that declares neither, the installed
    release's name."""
    kind = type(model)
    name = _NAMES.get(kind)
    if name is None:
        params = _forward_parameters(model)
        if "cache" in params:
            name = "cache"
        elif "past_key_values" in params:
            name = "past_key_values"
        else:
            name = "cache" if _transformers_version() >= _CACHE_RENAMED else "past_key_values"
        _NAMES[kind] = name
    return name


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(**inputs, **cache_kwargs(model, cache))``."""
    return {cache_kwarg(model): cache}


def is_checkpointing(model: Any) -> bool:
    """Whether activation (gradient) checkpointing is on for `model`, asked without the deprecated
    ``is_gradient_checkpointing`` where the model has ``is_activation_checkpointing``."""
    kind = type(model)
    if isinstance(getattr(kind, "is_activation_checkpointing", None), property):
        return bool(model.is_activation_checkpointing)
    if isinstance(getattr(kind, "is_gradient_checkpointing", None), property):
        return bool(model.is_gradient_checkpointing)
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
