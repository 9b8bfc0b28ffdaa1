"""Tools: plain Python functions a model may call, their JSON schemas, and a contained way to run them.

A tool is any function (sync or async) with type hints; its OpenAI function-tool schema comes from
the signature (types via pydantic) and a Google-style docstring (descriptions)::

    def calc(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: digits, + - * / and parentheses, e.g. "12*34".
        \"\"\"

`ToolRegistry` holds the tools of an episode; `call_tool` runs one `ToolCall` and never raises: an
unknown tool, arguments that do not fit the signature, an exception or a timeout becomes a
`ToolResult` with ``ok=False`` and a message fit to show the model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pydantic
from transformers.utils.chat_template_utils import parse_google_format_docstring

from weir.plugins import resolve
from weir.rollout.tool_calls import TAG_INPUT, ToolCall

__all__ = [
    "ToolResult",
    "ToolRegistry",
    "tool_schema",
    "call_tool",
    "call_tool_sync",
    "TOOLS",
]

# Built-in tools by name (a config's `agent.tools` may list these names or dotted paths).
TOOLS: dict[str, Callable[..., Any]] = {}

ERROR_KINDS = ("unknown_tool", "bad_arguments", "exception", "timeout")


@dataclass
class ToolResult:
    """What one call returned: `content` is the result as text, or the error message if not `ok`.

    `error_kind` is one of `ERROR_KINDS` when the call failed.
    """

    call: ToolCall
    content: str
    ok: bool = True
    error_kind: str | None = None


def tool_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI function-tool schema of `fn`:
    ``{"type": "function", "function": {"name", "description", "parameters"}}``.

    Parameter types come from the type hints (pydantic's JSON schema; unannotated means any type),
    descriptions from the docstring's summary and its ``Args:`` section. Built once per plain
    function (about a millisecond of pydantic each time, and a multi-turn rollout builds an
    environment, and renders its tools, for every episode); each call returns a fresh copy.
    """
    name = name or _name(fn)
    if not _static(fn):
        return _schema(fn, name)
    return copy.deepcopy(_cached_schema(fn, name))


def _static(fn: Callable[..., Any]) -> bool:
    """A plain function that closes over nothing (a module's tool): what is built from it may be
    kept for the process. Bound methods, closures, partials and callable objects may hold an
    episode's resources (a sandbox, a connection), so nothing built from them is kept."""
    return inspect.isfunction(fn) and not fn.__closure__


@functools.lru_cache(maxsize=1024)
def _cached_schema(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    return _schema(fn, name)


@functools.lru_cache(maxsize=1024)
def _cached_validator(fn: Callable[..., Any]) -> Callable[..., Any]:
    return pydantic.validate_call(fn)


def _validated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` behind pydantic's argument validation, built once per plain function (`_static`)."""
    return _cached_validator(fn) if _static(fn) else pydantic.validate_call(fn)


def _schema(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    try:
        params = pydantic.TypeAdapter(fn).json_schema()
    except Exception as e:  # pydantic cannot express a hint: name the tool and the fix
        raise ValueError(
            f"tool {name!r}: cannot build a JSON schema from its signature "
            f"({type(e).__name__}: {e}); use JSON-compatible type hints (str, int, float, bool, "
            "list, dict, Literal, pydantic models)"
        ) from e
    params = _drop_titles(params)
    params.setdefault("properties", {})
    params.setdefault("type", "object")
    summary, arg_docs, _ = parse_google_format_docstring(inspect.getdoc(fn) or "")
    for arg, doc in (arg_docs or {}).items():
        if arg in params["properties"] and doc:
            params["properties"][arg]["description"] = " ".join(doc.split())
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": " ".join((summary or "").split()),
            "parameters": params,
        },
    }


class ToolRegistry:
    """The tools available in an episode, by name.

    Build from callables, a ``{name: fn}`` mapping, or specs (a built-in name from `TOOLS` or a
    dotted path ``pkg.mod:fn``). `register` also works as a decorator.
    """

    def __init__(
        self,
        tools: Iterable[Callable[..., Any] | str] | Mapping[str, Callable[..., Any]] = (),
        *,
        timeout_s: float | None = 10.0,
    ) -> None:
        self.timeout_s = timeout_s
        self._tools: dict[str, Callable[..., Any]] = {}
        if isinstance(tools, Mapping):
            for name, fn in tools.items():
                self.register(fn, name=name)
        else:
            for spec in tools:
                self.register(resolve(spec, TOOLS, "tool"))

    def register(self, fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
        """Add `fn` under `name` (default: its ``__name__``); returns `fn`. Checks its schema now."""
        name = name or _name(fn)
        tool_schema(fn, name)
        self._tools[name] = fn
        return fn

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def get(self, name: str) -> Callable[..., Any] | None:
        return self._tools.get(name)

    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI tool schemas, for ``tokenizer.apply_chat_template(..., tools=...)``."""
        return [tool_schema(fn, name) for name, fn in self._tools.items()]

    async def call(self, call: ToolCall, timeout_s: float | None = None) -> ToolResult:
        return await call_tool(
            self, call, timeout_s=self.timeout_s if timeout_s is None else timeout_s
        )


async def call_tool(
    tools: ToolRegistry | Mapping[str, Callable[..., Any]] | Callable[..., Any],
    call: ToolCall,
    *,
    timeout_s: float | None = 10.0,
) -> ToolResult:
    """Run `call` against `tools` (a registry, a ``{name: fn}`` mapping, or the one function).

    Arguments are validated and coerced to the signature (pydantic ``validate_call``). Sync tools
    run in a worker thread, async tools are awaited, both under `timeout_s`. Never raises except
    on cancellation; a timed-out sync tool's thread cannot be killed and runs on in the background.
    """
    bound = _bind(tools, call)
    if isinstance(bound, ToolResult):
        return bound
    fn, args = bound
    try:
        if inspect.iscoroutinefunction(fn):
            coro = _validated(fn)(**args)
        else:
            coro = asyncio.to_thread(_validated(fn), **args)
        result = await (asyncio.wait_for(coro, timeout_s) if timeout_s is not None else coro)
        if inspect.isawaitable(result):
            result = await (
                asyncio.wait_for(result, timeout_s) if timeout_s is not None else result
            )
    except asyncio.CancelledError:
        raise
    except (asyncio.TimeoutError, TimeoutError):
        return _error(call, "timeout", f"tool {call.name!r} timed out after {timeout_s} s")
    except pydantic.ValidationError as e:
        return _error(call, "bad_arguments", _validation_message(call.name, e))
    except Exception as e:
        return _error(call, "exception", f"tool {call.name!r} raised {type(e).__name__}: {e}")
    return ToolResult(call=call, content=_to_text(result))


def call_tool_sync(
    tools: ToolRegistry | Mapping[str, Callable[..., Any]] | Callable[..., Any],
    call: ToolCall,
    *,
    timeout_s: float | None = 10.0,
) -> ToolResult:
    """`call_tool` for code without an event loop (async tools are run with ``asyncio.run``)."""
    bound = _bind(tools, call)
    if isinstance(bound, ToolResult):
        return bound
    fn, args = bound
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        if inspect.iscoroutinefunction(fn):
            future = pool.submit(asyncio.run, _validated(fn)(**args))
        else:
            future = pool.submit(_validated(fn), **args)
        result = future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        return _error(call, "timeout", f"tool {call.name!r} timed out after {timeout_s} s")
    except pydantic.ValidationError as e:
        return _error(call, "bad_arguments", _validation_message(call.name, e))
    except Exception as e:
        return _error(call, "exception", f"tool {call.name!r} raised {type(e).__name__}: {e}")
    finally:
        pool.shutdown(wait=False)
    return ToolResult(call=call, content=_to_text(result))


def _bind(
    tools: ToolRegistry | Mapping[str, Callable[..., Any]] | Callable[..., Any], call: ToolCall
) -> tuple[Callable[..., Any], dict[str, Any]] | ToolResult:
    """The function `call` names and its keyword arguments, or an error result."""
    if isinstance(tools, ToolRegistry):
        fn, names = tools.get(call.name), tools.names
    elif isinstance(tools, Mapping):
        fn, names = tools.get(call.name), list(tools)
    else:
        names = [_name(tools)]
        fn = tools if call.name == names[0] else None
    if fn is None:
        return _error(call, "unknown_tool", f"unknown tool {call.name!r}; available tools: {names}")
    args = dict(call.arguments)
    if set(args) == {TAG_INPUT}:
        params = inspect.signature(fn).parameters
        if TAG_INPUT not in params:
            required = [
                p
                for p in params.values()
                if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            target = required[0] if len(required) == 1 else None
            if target is None and len(params) == 1:
                target = next(iter(params.values()))
            if target is not None:
                args = {target.name: args[TAG_INPUT]}
    return fn, args


def _validation_message(name: str, e: pydantic.ValidationError) -> str:
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}" for err in e.errors()
    )
    return f"bad arguments for tool {name!r}: {problems}"


def _error(call: ToolCall, kind: str, message: str) -> ToolResult:
    return ToolResult(call=call, content=message, ok=False, error_kind=kind)


def _to_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(result)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _drop_titles(schema: Any) -> Any:
    """pydantic's schema without its auto-generated ``title`` keys (noise in a prompt)."""
    if isinstance(schema, dict):
        return {
            k: _drop_titles(v)
            for k, v in schema.items()
            if not (k == "title" and isinstance(v, str))
        }
    if isinstance(schema, list):
        return [_drop_titles(v) for v in schema]
    return schema
