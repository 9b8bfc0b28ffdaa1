"""Name registries and the dotted-path resolver.

A registry maps a name (``"grpo"``) to a plain function. Everything that accepts a
registered name also accepts a callable, or a dotted path to a user function with the
same signature: ``"my_pkg.mod:fn"`` or ``"my_pkg.mod.fn"``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from weir.plugins import resolve as resolve_plugin

__all__ = ["Registry", "resolve", "call_with_options", "suggest"]

F = TypeVar("F", bound=Callable[..., Any])


def suggest(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the nearest choice by difflib, or ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


class Registry(dict[str, Callable[..., Any]]):
    """A ``dict`` of name -> function, with a human name for error messages.

    ``@REG.register("name")`` adds a function; plain item assignment works too.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator that registers ``fn`` under ``name`` (a duplicate name is an error)."""

        def deco(fn: F) -> F:
            if name in self and self[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self[name] = fn
            return fn

        return deco

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self)})"


def resolve(
    name_or_fn: str | Callable[..., Any],
    registry: Mapping[str, Callable[..., Any]] | None = None,
    *,
    kind: str | None = None,
) -> Callable[..., Any]:
    """Turn a registered name, a dotted path or a callable into a callable.

    Lookup order: a callable is returned as is; a string found in ``registry`` returns the
    registered function; a string containing ``:`` or ``.`` is imported
    (``"pkg.mod:fn"``, ``"pkg.mod.fn"``, ``"pkg.mod:Class.method"``).

    Raises:
        ValueError: unknown name (the message lists the valid names and the nearest
            one), unimportable path, or a resolved object that is not callable.
    """
    return resolve_plugin(name_or_fn, registry or {}, kind or getattr(registry, "kind", "function"))


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def call_with_options(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    options: dict[str, Any],
    *,
    kind: str,
) -> Any:
    """Call ``fn(*args, **options)`` after checking the option names against its signature.

    A required argument of ``fn`` that is not given is a ValueError naming it. A function
    that takes ``**kwargs`` receives every option; otherwise an option that the function
    does not declare is a ValueError naming the function, the option, the valid options
    and the nearest one, so that a misspelt ``gama=`` never passes silently.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn(*args, **options)
    rest = list(sig.parameters.items())[len(args) :]
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    missing = [n for n, p in rest if p.kind in named and p.default is p.empty and n not in options]
    if missing:
        raise ValueError(
            f"{kind} {_fn_name(fn)!r} needs {', '.join(f'{n}=' for n in missing)} "
            "(missing argument)"
        )
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for _, p in rest):
        accepted = [n for n, p in rest if p.kind in named]
        for key in options:
            if key not in accepted:
                raise ValueError(
                    f"{kind} {_fn_name(fn)!r} does not take the option {key!r}; "
                    f"it takes: {', '.join(accepted) or '(no options)'}{suggest(key, accepted)}"
                )
    return fn(*args, **options)
