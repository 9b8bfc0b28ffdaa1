"""Resolve a plug-in spec (a registry name, a dotted path, or a callable) to the object it names.

Every extension point in weir (reward, rollout function, filter, advantage, data source, ...) is
configured the same way: a built-in name such as ``"math"``, or a dotted path to user code such as
``"my_pkg.rewards:score"`` (or ``"my_pkg.rewards.score"``), or, from Python, the callable itself.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["resolve", "import_path"]


def resolve(
    spec: str | Callable[..., Any],
    registry: Mapping[str, Callable[..., Any]],
    kind: str,
    *,
    require_callable: bool = True,
) -> Any:
    """Return the object that `spec` names.

    - a callable passes through unchanged;
    - a key of `registry` returns that entry;
    - a dotted path ``pkg.mod:attr`` (attr may itself be dotted, ``pkg.mod:Cls.method``) or
      ``pkg.mod.attr`` is imported.

    Raises ValueError naming `kind` and `spec` for an unknown name (with the valid names and the
    nearest match), a module that cannot be imported (with the original error), a missing
    attribute, or (with `require_callable`) an object that is not callable.
    """
    if callable(spec) and not isinstance(spec, str):
        return spec
    if not isinstance(spec, str):
        raise ValueError(
            f"{kind} must be a name, a dotted path 'pkg.module:attr' or a callable; "
            f"got {type(spec).__name__} {spec!r}"
        )
    name = spec.strip()
    if name in registry:
        return registry[name]
    if ":" not in name and "." not in name:
        valid = sorted(registry)
        nearest = difflib.get_close_matches(name, valid, n=1)
        hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
        raise ValueError(
            f"unknown {kind} {spec!r}: valid names are {valid}{hint} "
            f"(or give a dotted path 'pkg.module:function')"
        )
    obj = import_path(name, kind=kind)
    if require_callable and not callable(obj):
        raise ValueError(
            f"{kind} {spec!r} resolved to a {type(obj).__name__}, which is not callable"
        )
    return obj


def import_path(path: str, *, kind: str = "object") -> Any:
    """Import ``pkg.mod:attr.sub`` or ``pkg.mod.attr`` and return the attribute.

    Without a colon the longest importable module prefix is used, so ``pkg.mod.attr`` works even
    when ``pkg.mod.attr`` is not itself a module.
    """
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
        if not module_name or not attr_path:
            raise ValueError(f"{kind} {path!r}: a dotted path needs the form 'pkg.module:attr'")
        module = _import_module(module_name, path, kind)
        return _get_attr_path(module, module_name, attr_path, path, kind)

    parts = path.split(".")
    if any(not p for p in parts):
        raise ValueError(f"{kind} {path!r} is not a valid dotted path")
    first_error: ModuleNotFoundError | None = None
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only "this very module (or a parent) does not exist" means: try a shorter prefix.
            if e.name is not None and (
                module_name == e.name or module_name.startswith(e.name + ".")
            ):
                first_error = first_error or e
                continue
            raise ValueError(
                f"{kind} {path!r}: importing module {module_name!r} failed: {type(e).__name__}: {e}"
            ) from e
        except Exception as e:
            raise ValueError(
                f"{kind} {path!r}: importing module {module_name!r} failed: {type(e).__name__}: {e}"
            ) from e
        return _get_attr_path(module, module_name, ".".join(parts[i:]), path, kind)
    raise ValueError(
        f"{kind} {path!r}: cannot import module {'.'.join(parts[:-1])!r}: "
        f"{type(first_error).__name__}: {first_error}"
    ) from first_error


def _import_module(module_name: str, path: str, kind: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(
            f"{kind} {path!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}"
        ) from e


def _get_attr_path(module: Any, module_name: str, attr_path: str, path: str, kind: str) -> Any:
    obj = module
    owner = module_name
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            public = sorted(a for a in dir(obj) if not a.startswith("_"))
            nearest = difflib.get_close_matches(attr, public, n=1)
            hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
            raise ValueError(f"{kind} {path!r}: {owner!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, attr)
        owner = f"{owner}.{attr}"
    return obj
