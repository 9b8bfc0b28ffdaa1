"""Tool-call formats of real model families: how each writes a call, parsed and rendered.

Each format is an object with ``parse(text, tools) -> ParsedTurn`` and ``render(calls) -> str``
(`render` writes what the family's chat template writes for an assistant message's
``tool_calls``, so ``parse(render(calls))`` gives the calls back), and ``special_tokens``: whether
its markers are special tokens of the family's tokenizer, so that the turn must be decoded with
special tokens kept before parsing (`weir.rollout.tool_calls.needs_special_tokens`).

| name | families | a call as the model writes it |
| --- | --- | --- |
| ``qwen3_coder`` | Qwen3-Coder | ``<tool_call>\\n<function=calc>\\n<parameter=expression>\\n12*34\\n</parameter>\\n</function>\\n</tool_call>`` |
| ``llama3_json`` | Llama 3.1 / 3.2 / 3.3 | ``{"name": "calc", "parameters": {"expression": "12*34"}}`` |
| ``mistral`` | Mistral (v3 tokenizer and later) | ``[TOOL_CALLS] [{"name": "calc", "arguments": {...}, "id": "a1b2c3d4e"}]`` |
| ``deepseek_v3`` | DeepSeek-V3, R1 | ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>`` |
| ``harmony`` | GPT-OSS | ``<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{...}<|call|>`` |

The Hermes / Qwen 2.5 / Qwen 3 format and weir's ``tag`` format live in `weir.rollout.tool_calls`.
Parsers never raise: a malformed call is a message in ``ParsedTurn.errors``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

from weir.rollout.tool_calls import Hermes, ParsedTurn, Tag, ToolCall, new_call_id

__all__ = [
    "TOOL_FORMATS",
    "FORMATS",
    "Qwen3Coder",
    "Llama3Json",
    "Mistral",
    "DeepSeekV3",
    "Harmony",
    "tool_params",
]


def tool_params(tools: Collection[Any] | None) -> dict[str, dict[str, Any]]:
    """``{tool name: its JSON-schema properties}`` from OpenAI tool schemas (names alone give
    none): what the XML-parameter format needs to turn a parameter's text back into its type."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or ():
        if isinstance(t, dict):
            f = t.get("function", t)
            if isinstance(f, dict) and isinstance(f.get("name"), str):
                props = (f.get("parameters") or {}).get("properties") or {}
                out[f["name"]] = props if isinstance(props, dict) else {}
    return out


def _json_call(obj: Any, where: str, errors: list[str], args_keys=("arguments", "parameters")):
    """A `ToolCall` from a decoded ``{"name", "arguments"|"parameters"}`` object, or None (the
    problem appended to `errors`)."""
    if not isinstance(obj, dict):
        errors.append(f"{where}: a call must be a JSON object with 'name', got {obj!r:.120}")
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        errors.append(f"{where}: a call has no 'name' string: {json.dumps(obj)[:200]}")
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            errors.append(f"{where}: call {name!r} has arguments that are a string, not JSON")
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        errors.append(f"{where}: call {name!r}: arguments must be an object, got {args!r:.80}")
        return None
    call_id = obj.get("id")
    return ToolCall(name, args, call_id if isinstance(call_id, str) and call_id else new_call_id())


def _dumps(value: Any) -> str:
    """JSON as chat templates' ``tojson`` writes it (non-ASCII kept, default separators)."""
    return json.dumps(value, ensure_ascii=False)


# ------------------------------------------------------------------------------- Qwen3-Coder


class Qwen3Coder:
    """Qwen3-Coder: XML parameters inside ``<tool_call>``. A parameter's value is raw text (no
    escaping); the template writes objects and lists as JSON and other values with Jinja's
    ``string`` (``True``, ``None``). Parsing types each value by the tool's schema when `tools`
    carries schemas (string stays text; integer, number, boolean, object, array are decoded),
    else by trying JSON, then keeping the text."""

    name = "qwen3_coder"
    special_tokens = False
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
    _FUNC = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def render(self, calls: list[ToolCall]) -> str:
        parts = []
        for c in calls:
            body = "".join(
                f"<parameter={k}>\n{self._value_text(v)}\n</parameter>\n"
                for k, v in c.arguments.items()
            )
            parts.append(f"<tool_call>\n<function={c.name}>\n{body}</function>\n</tool_call>")
        return "\n".join(parts)

    @staticmethod
    def _value_text(v: Any) -> str:
        return _dumps(v) if isinstance(v, (dict, list)) else str(v)

    def parse(self, text: str, tools: Collection[Any] | None = None) -> ParsedTurn:
        params = tool_params(tools)
        calls: list[ToolCall] = []
        errors: list[str] = []
        first = text.find("<tool_call>")
        content = text if first < 0 else text[:first]
        for m in self._CALL.finditer(text):
            if not m.group(0).endswith("</tool_call>") and "</function>" not in m.group(1):
                errors.append("unclosed <tool_call> (missing </function> and </tool_call>)")
                continue
            f = self._FUNC.search(m.group(1))
            if f is None:
                errors.append(f"<tool_call> without <function=name>: {m.group(1)[:200]!r}")
                continue
            name = f.group(1).strip()
            schema = params.get(name, {})
            args = {
                p.group(1).strip(): self._typed(p.group(2), schema.get(p.group(1).strip()))
                for p in self._PARAM.finditer(f.group(2))
            }
            calls.append(ToolCall(name, args))
        return ParsedTurn(content=content.strip(), calls=calls, errors=errors)

    @staticmethod
    def _typed(raw: str, schema: Any) -> Any:
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind == "string":
            return raw
        if kind == "boolean" and raw.strip() in ("True", "False", "true", "false"):
            return raw.strip() in ("True", "true")
        if raw.strip() in ("None", "null") and kind in (None, "null"):
            return None
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return raw
        if kind is None and isinstance(value, str):
            return raw
        return value


# ------------------------------------------------------------------------------------ Llama 3


class Llama3Json:
    """Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole turn is ``{"name": ..., "parameters":
    {...}}`` (``arguments`` is accepted too), optionally after ``<|python_tag|>``; several calls
    are separated by ``;``. A turn that does not start with ``{`` is plain content."""

    name = "llama3_json"
    special_tokens = False
    _PYTHON_TAG = "<|python_tag|>"

    def render(self, calls: list[ToolCall]) -> str:
        return "; ".join(
            f'{{"name": "{c.name}", "parameters": {_dumps(c.arguments)}}}' for c in calls
        )

    def parse(self, text: str, tools: Collection[Any] | None = None) -> ParsedTurn:
        body = text.strip()
        if body.startswith(self._PYTHON_TAG):
            body = body[len(self._PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return ParsedTurn(content=text.strip())
        calls: list[ToolCall] = []
        errors: list[str] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as e:
                errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos})")
                break
            call = _json_call(obj, "llama3_json", errors)
            if call is not None:
                calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return ParsedTurn(content="", calls=calls, errors=errors)


# ------------------------------------------------------------------------------------ Mistral


class Mistral:
    """Mistral's ``[TOOL_CALLS]`` (a control token): a JSON list of ``{"name", "arguments",
    "id"}`` with 9-character ids (v3 tokenizers), or, in v11+ tokenizers, ``name[ARGS]{json}``
    per call (optionally ``name[CALL_ID]id[ARGS]{json}``). Render writes the JSON list, with each
    id cut to its last 9 characters as the template does."""

    name = "mistral"
    special_tokens = True
    MARK = "[TOOL_CALLS]"
    _V11 = re.compile(r"\s*([^\[\]\s]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")

    def render(self, calls: list[ToolCall]) -> str:
        items = [
            _dumps({"name": c.name, "arguments": c.arguments})[:-1] + f', "id": "{c.id[-9:]}"}}'
            for c in calls
        ]
        return f"{self.MARK} [" + ", ".join(items) + "]"

    def parse(self, text: str, tools: Collection[Any] | None = None) -> ParsedTurn:
        start = text.find(self.MARK)
        if start < 0:
            return ParsedTurn(content=text.strip())
        content, rest = text[:start], text[start:]
        calls: list[ToolCall] = []
        errors: list[str] = []
        decoder = json.JSONDecoder()
        for chunk in rest.split(self.MARK)[1:]:
            body = chunk.strip()
            if body.startswith("["):
                try:
                    items, _ = decoder.raw_decode(body)
                except json.JSONDecodeError as e:
                    errors.append(f"[TOOL_CALLS] list is not valid JSON ({e.msg} at char {e.pos})")
                    continue
                for obj in items if isinstance(items, list) else [items]:
                    call = _json_call(obj, "mistral", errors)
                    if call is not None:
                        calls.append(call)
                continue
            pos = 0
            while pos < len(chunk):
                m = self._V11.match(chunk, pos)
                if m is None:
                    errors.append(
                        f"[TOOL_CALLS] not followed by a call: {chunk[pos : pos + 200]!r}"
                    )
                    break
                try:
                    args, end = decoder.raw_decode(chunk, m.end())
                except json.JSONDecodeError as e:
                    errors.append(f"call {m.group(1)!r}: [ARGS] is not valid JSON ({e.msg})")
                    break
                call = _json_call(
                    {"name": m.group(1), "arguments": args, "id": m.group(2)}, "mistral", errors
                )
                if call is not None:
                    calls.append(call)
                pos = end
                if not chunk[pos:].strip():
                    break
        return ParsedTurn(content=content.strip(), calls=calls, errors=errors)


# -------------------------------------------------------------------------------- DeepSeek-V3


class DeepSeekV3:
    """DeepSeek-V3 / R1: calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``,
    each ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{args}\\n```<｜tool▁call▁end｜>``
    (V3.1's ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{args}<｜tool▁call▁end｜>`` parses too)."""

    name = "deepseek_v3"
    special_tokens = True
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    _FENCED = re.compile(r"\A\s*([^\n]*)\n```(?:json)?\n(.*?)\n```\s*\Z", re.DOTALL)

    def render(self, calls: list[ToolCall]) -> str:
        items = [
            f"{self.CALL}function{self.SEP}{c.name}\n```json\n{_dumps(c.arguments)}\n```"
            f"{self.CALL_END}"
            for c in calls
        ]
        return self.BEGIN + "\n".join(items) + self.END

    def parse(self, text: str, tools: Collection[Any] | None = None) -> ParsedTurn:
        start = text.find(self.BEGIN)
        if start < 0:
            return ParsedTurn(content=text.strip())
        content, rest = text[:start], text[start + len(self.BEGIN) :]
        calls: list[ToolCall] = []
        errors: list[str] = []
        for piece in rest.split(self.CALL)[1:]:
            end = piece.find(self.CALL_END)
            if end < 0:
                errors.append(f"unclosed {self.CALL} (missing {self.CALL_END})")
                continue
            kind, sep, after = piece[:end].partition(self.SEP)
            if not sep:
                errors.append(f"tool call without {self.SEP}: {piece[:200]!r}")
                continue
            fenced = self._FENCED.match(after)
            if fenced is not None:  # V3: type<sep>name\n```json\n{args}\n```
                name, raw = fenced.group(1).strip(), fenced.group(2)
            else:  # V3.1: name<sep>{args}
                name, raw = kind.strip(), after
            try:
                args = json.loads(raw)
            except json.JSONDecodeError as e:
                errors.append(f"call {name!r}: arguments are not valid JSON ({e.msg})")
                continue
            call = _json_call({"name": name, "arguments": args}, "deepseek_v3", errors)
            if call is not None:
                calls.append(call)
        return ParsedTurn(content=content.strip(), calls=calls, errors=errors)


# ------------------------------------------------------------------------------------ Harmony


class Harmony:
    """GPT-OSS's harmony format: a turn is messages ``<|channel|>CHANNEL HEADER<|message|>BODY``
    ended by ``<|end|>``, ``<|call|>`` or ``<|return|>`` (later ones open with
    ``<|start|>assistant``). A message whose header holds ``to=functions.NAME`` is a call with a
    JSON body; the model writes ``<|channel|>commentary to=functions.NAME <|constrain|>json``,
    GPT-OSS's chat template re-renders past calls as ``<|start|>assistant to=functions.NAME
    <|channel|>commentary json``; both parse. Content is the ``final`` channel (or, with no
    channel at all, the text); the ``analysis`` channel (reasoning) is dropped."""

    name = "harmony"
    special_tokens = True
    _MESSAGE = re.compile(
        r"(?:<\|start\|>)?(?P<head>[^<]*(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>[^<]*)?)"
        r"<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|\Z)",
        re.DOTALL,
    )
    _TO = re.compile(r"to=functions\.([^\s<]+)")

    def render(self, calls: list[ToolCall]) -> str:
        return "<|start|>assistant".join(
            f"<|channel|>commentary to=functions.{c.name} <|constrain|>json<|message|>"
            f"{_dumps(c.arguments)}<|call|>"
            for c in calls
        )

    def parse(self, text: str, tools: Collection[Any] | None = None) -> ParsedTurn:
        if "<|message|>" not in text:
            return ParsedTurn(content=text.strip())
        calls: list[ToolCall] = []
        errors: list[str] = []
        finals: list[str] = []
        for m in self._MESSAGE.finditer(text):
            head, body = m.group("head"), m.group("body")
            to = self._TO.search(head)
            if to is None:
                if "analysis" not in head:
                    finals.append(body)
                continue
            try:
                args = json.loads(body) if body.strip() else {}
            except json.JSONDecodeError as e:
                errors.append(f"call {to.group(1)!r}: arguments are not valid JSON ({e.msg})")
                continue
            call = _json_call({"name": to.group(1), "arguments": args}, "harmony", errors)
            if call is not None:
                calls.append(call)
        return ParsedTurn(content="\n".join(finals).strip(), calls=calls, errors=errors)


_HERMES = Hermes()
TOOL_FORMATS: dict[str, Any] = {
    "hermes": _HERMES,
    "qwen2_5": _HERMES,
    "qwen3": _HERMES,
    "tag": Tag(),
    "qwen3_coder": Qwen3Coder(),
    "llama3_json": Llama3Json(),
    "mistral": Mistral(),
    "deepseek_v3": DeepSeekV3(),
    "harmony": Harmony(),
}
"""Tool-call formats by name (``qwen2_5`` and ``qwen3`` are ``hermes``); a format of your own is
named by dotted path (`weir.rollout.tool_calls.get_tool_format`)."""
FORMATS = tuple(TOOL_FORMATS)
