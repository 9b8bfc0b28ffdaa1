"""Tool calls in model text: parse them out of a turn, and render them back (for chat templates).

Formats are looked up by name (`get_tool_format`, the registry
`weir.rollout.tool_formats.TOOL_FORMATS`) that a plugin
extends by dotted path: any object with ``parse(text, tools) -> ParsedTurn``,
``render(calls) -> str`` and ``special_tokens: bool`` (a class is instantiated). The formats of
real model families (Qwen3-Coder, Llama 3, Mistral, DeepSeek-V3, GPT-OSS harmony) are in
`weir.rollout.tool_formats`; the two defined here:

- ``"hermes"`` (Hermes / Qwen): each call is a JSON object between tags,
  ``<tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call>``.
  ``arguments`` may also be a JSON string holding an object (OpenAI style). A final ``<tool_call>``
  left unclosed (the model stopped right after the JSON) is accepted if its JSON parses.
- ``"tag"``: a format a tiny model can learn in a few hundred SFT steps, ``<calc>12*34</calc>``.
  The tag is the tool name; the body is either a JSON object (the arguments) or plain text, which
  becomes ``{"input": body}`` (`TAG_INPUT`); `weir.rollout.tools.call_tool` binds ``input`` to the
  tool's single required parameter. Pass ``tools=`` (the known names) so that other tags such as
  ``<b>`` stay plain text and an unclosed ``<calc>`` is reported as malformed; without it, any
  ``<name>...</name>`` pair except `RESERVED_TAGS` is a call.

Malformed calls never raise: they are listed in `ParsedTurn.errors` (one readable message each,
fit to show to the model as an error observation) and left out of `ParsedTurn.calls`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "get_tool_format",
    "needs_special_tokens",
    "raw_turn_text",
    "tool_names",
    "TAG_INPUT",
    "RESERVED_TAGS",
    "ToolCall",
    "ParsedTurn",
    "parse_tool_calls",
    "render_tool_calls",
    "new_call_id",
]

TAG_INPUT = "input"
RESERVED_TAGS = frozenset({"think", "tool_call", "tool_response", "answer"})

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"
_TAG = re.compile(r"<([A-Za-z_][\w.-]*)>(.*?)</\1>", re.DOTALL)
_TAG_OPEN = re.compile(r"<([A-Za-z_][\w.-]*)>")


@dataclass
class ToolCall:
    """One call: the tool's name, its arguments (a JSON object), and an id to match its result."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: new_call_id())


@dataclass
class ParsedTurn:
    """A model turn split into its text outside the calls, the well-formed calls, and errors."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def new_call_id() -> str:
    """A fresh OpenAI-style call id, ``call_`` + 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(
    text: str, fmt: Any = "hermes", *, tools: Collection[Any] | None = None
) -> ParsedTurn:
    """Split `text` into content and tool calls in format `fmt` (a name in `TOOL_FORMATS`, a
    dotted path, or a format object).

    `tools`, if given, are the known tools: names, or OpenAI tool schemas (formats that type
    arguments by schema, such as ``qwen3_coder``, need the schemas). In the tag format only those
    tags are calls; in the others a call to an unknown name is still returned (executing it
    reports the error). Never raises on any text.
    """
    return get_tool_format(fmt).parse(text, tools)


def render_tool_calls(calls: list[ToolCall], fmt: Any = "hermes") -> str:
    """The text a model writes to make `calls`; `parse_tool_calls` of it returns the same calls."""
    return get_tool_format(fmt).render(calls)


def get_tool_format(spec: Any) -> Any:
    """The format `spec` names: a key of `TOOL_FORMATS`, a dotted path ``pkg.mod:Format`` (a class
    is instantiated), or an object with ``parse`` and ``render``. Raises ValueError naming the
    valid names for anything else."""
    from weir.plugins import resolve
    from weir.rollout.tool_formats import TOOL_FORMATS  # its formats import this module

    if not isinstance(spec, str) and hasattr(spec, "parse") and hasattr(spec, "render"):
        return spec
    fmt = resolve(spec, TOOL_FORMATS, "tool format", require_callable=False)
    if isinstance(fmt, type):
        fmt = fmt()
    if not (callable(getattr(fmt, "parse", None)) and callable(getattr(fmt, "render", None))):
        raise ValueError(
            f"tool format {spec!r} has no parse(text, tools) and render(calls) methods"
        )
    return fmt


def needs_special_tokens(fmt: Any) -> bool:
    """Whether `fmt`'s markers are special tokens, so its turns are parsed from text decoded with
    special tokens kept (``skip_special_tokens=False``, the turn's closing stop token removed)."""
    return bool(getattr(get_tool_format(fmt), "special_tokens", False))


def raw_turn_text(tokenizer: Any, token_ids: list[int], finish_reason: str = "stop") -> str:
    """A model turn decoded with its special tokens kept (for formats whose markers are special
    tokens), less the special token that closed it (EOS, ``<|call|>``, ...)."""
    ids = list(token_ids)
    if finish_reason == "stop" and ids and not tokenizer.decode(ids[-1:], skip_special_tokens=True):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def tool_names(tools: Collection[Any] | None) -> list[str] | None:
    """Tool names from names or OpenAI tool schemas."""
    if tools is None:
        return None
    names = []
    for t in tools:
        if isinstance(t, dict):
            f = t.get("function", t)
            if isinstance(f, dict) and isinstance(f.get("name"), str):
                names.append(f["name"])
        else:
            names.append(str(t))
    return names


class Hermes:
    """Hermes, Qwen 2.5 and Qwen 3: a JSON object per call between ``<tool_call>`` tags."""

    name = "hermes"
    special_tokens = False

    def parse(self, text: str, tools: Collection[Any] | None = None) -> ParsedTurn:
        return _parse_hermes(text)

    def render(self, calls: list[ToolCall]) -> str:
        return "\n".join(
            "<tool_call>\n"
            + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
            + "\n</tool_call>"
            for c in calls
        )


class Tag:
    """weir's format for tiny models: ``<calc>12*34</calc>``."""

    name = "tag"
    special_tokens = False

    def parse(self, text: str, tools: Collection[Any] | None = None) -> ParsedTurn:
        return _parse_tag(text, tool_names(tools))

    def render(self, calls: list[ToolCall]) -> str:
        parts = []
        for c in calls:
            args = c.arguments
            if set(args) == {TAG_INPUT} and isinstance(args[TAG_INPUT], str):
                body = args[TAG_INPUT]
            else:
                body = json.dumps(args, ensure_ascii=False)
            parts.append(f"<{c.name}>{body}</{c.name}>")
        return "".join(parts)


def _parse_hermes(text: str) -> ParsedTurn:
    calls: list[ToolCall] = []
    errors: list[str] = []
    pieces: list[str] = []
    pos = 0
    for m in _HERMES.finditer(text):
        pieces.append(text[pos : m.start()])
        pos = m.end()
        _add_json_call(m.group(1), calls, errors)
    rest = text[pos:]
    start = rest.find(_HERMES_OPEN)
    if start >= 0:
        pieces.append(rest[:start])
        body = rest[start + len(_HERMES_OPEN) :]
        before = len(errors)
        _add_json_call(body, calls, errors)
        if len(errors) > before:
            errors[-1] = "unclosed <tool_call> (missing </tool_call>): " + errors[-1]
    else:
        pieces.append(rest)
    return ParsedTurn(content=_join(pieces), calls=calls, errors=errors)


def _add_json_call(body: str, calls: list[ToolCall], errors: list[str]) -> None:
    body = body.strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos}): {body[:200]!r}")
        return
    if not isinstance(obj, dict):
        errors.append(
            f"tool call must be a JSON object with 'name' and 'arguments': {body[:200]!r}"
        )
        return
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        errors.append(f"tool call has no 'name' string: {body[:200]!r}")
        return
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            errors.append(f"tool call {name!r}: 'arguments' is a string that is not JSON")
            return
    if args is None:
        args = {}
    if not isinstance(args, dict):
        errors.append(
            f"tool call {name!r}: 'arguments' must be a JSON object, got {type(args).__name__}"
        )
        return
    call_id = obj.get("id")
    calls.append(
        ToolCall(
            name=name, arguments=args, id=call_id if isinstance(call_id, str) else new_call_id()
        )
    )


def _parse_tag(text: str, tools: Collection[str] | None) -> ParsedTurn:
    known = set(tools) if tools is not None else None

    def is_tool(name: str) -> bool:
        return name in known if known is not None else name not in RESERVED_TAGS

    calls: list[ToolCall] = []
    errors: list[str] = []
    pieces: list[str] = []
    pos = 0
    search = 0
    while True:
        m = _TAG.search(text, search)
        if m is None:
            break
        if not is_tool(m.group(1)):
            search = m.start() + 1
            continue
        pieces.append(text[pos : m.start()])
        pos = search = m.end()
        name, body = m.group(1), m.group(2)
        stripped = body.strip()
        if stripped.startswith("{"):
            try:
                args = json.loads(stripped)
            except json.JSONDecodeError as e:
                errors.append(f"<{name}> body is not valid JSON ({e.msg}): {stripped[:200]!r}")
                continue
            if not isinstance(args, dict):
                errors.append(f"<{name}> body must be a JSON object or plain text")
                continue
        else:
            args = {TAG_INPUT: stripped}
        calls.append(ToolCall(name=name, arguments=args))
    rest = text[pos:]
    if known is not None:
        for m in _TAG_OPEN.finditer(rest):
            if m.group(1) in known:
                errors.append(f"unclosed <{m.group(1)}> (missing </{m.group(1)}>)")
                rest = rest[: m.start()]
                break
    pieces.append(rest)
    return ParsedTurn(content=_join(pieces), calls=calls, errors=errors)


def _join(pieces: list[str]) -> str:
    return "".join(pieces).strip()
