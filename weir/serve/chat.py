"""Chat messages -> engine prompt ids, linked token-exactly to the session's previous turn.

The first call of a session is rendered with the tokenizer's chat template and tokenized. A later
call whose messages repeat the previous call's history plus the assistant message the server
returned, followed by new messages (tool results, a user turn), is *linked*: its prompt is

    previous prompt ids + previous response ids (as sampled, never re-tokenized)
    + the template's end-of-turn text the model did not emit itself (e.g. after a length cut)
    + the tokenized rendering of the new messages,

so the engine continues exactly the token sequence it produced. The text of the new messages is
found by rendering both histories with the template and taking the difference; when the template
does not render the longer history as an extension of the shorter one (some templates rewrite past
turns), or the client changed its history, the call starts a new segment from a fresh rendering.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from weir.rollout.tool_calls import ToolCall, get_tool_format, raw_turn_text
from weir.serve.protocol import ChatMessage
from weir.serve.trajectory import Turn


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as Hugging Face chat templates expect them (tool-call arguments as dicts)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        d["content"] = m.text()
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments_dict()},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _key(m: dict[str, Any]) -> tuple:
    """What must match for a message to count as the same turn (call ids may be regenerated)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in m.get("tool_calls") or ()
    )
    return (m["role"], (m.get("content") or "").strip(), calls)


@dataclass
class Prompt:
    ids: list[int]
    link: str  # "start", "extend" or "new: <why>"


class ChatFormatter:
    """Renders chat requests for one tokenizer; `stop_ids` are the ids that end an assistant turn."""

    message_key = staticmethod(_key)
    """What must match for a message of the history to count as the same turn."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int], tool_format: str = "hermes"):
        self.tokenizer = tokenizer
        self.stop_ids = [int(i) for i in stop_ids]
        self.stop_texts = {i: tokenizer.decode([i]) for i in self.stop_ids}
        self.tool_format = tool_format
        self.format = get_tool_format(tool_format)  # an unknown format stops the server's start

    def render(self, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation}
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: list[dict], tools: list[dict] | None, last: Turn | None) -> Prompt:
        """The engine prompt for `messages`, linked to `last` (the session's latest turn) if it can."""
        text = self.render(messages, tools, generation=True)
        if last is None:
            return Prompt(self.encode(text), "start")
        why = self._mismatch(messages, tools, last)
        if why is None:
            history = messages[: len(last.messages or [])]
            before = self.render(history, tools, generation=False)
            closing = self._closing(last, history, tools)
            if closing is not None and text.startswith(before):
                added = self.encode(closing + text[len(before) :])
                if added:
                    return Prompt(last.context + added, "extend")
            why = "the chat template does not render the new history as an extension of the old"
        return Prompt(self.encode(text), f"new: {why}")

    def _mismatch(self, messages: list[dict], tools: list[dict] | None, last: Turn) -> str | None:
        history = last.messages
        if history is None:
            return "the previous call was not a chat call"
        if last.output.get("tools") != tools:
            return "the tools changed"
        if len(messages) <= len(history):
            return "no new messages after the previous assistant turn"
        for i, (old, new) in enumerate(zip(history, messages, strict=False)):
            if self.message_key(old) != self.message_key(new):
                return f"message {i} differs from the recorded history"
        return None

    def _closing(self, last: Turn, history: list[dict], tools: list[dict] | None) -> str | None:
        """Template text that ends the previous assistant turn and that the model did not sample:
        the end-of-turn marker and what follows it when the model stopped without one, else only
        what the template puts after the marker (e.g. a newline)."""
        opened = self.render(history[:-1], tools, generation=True)
        closed = self.render(history, tools, generation=False)
        if not closed.startswith(opened):
            return None
        turn = closed[len(opened) :]
        pos, marker = -1, ""
        for text in self.stop_texts.values():
            i = turn.rfind(text) if text else -1
            if i > pos:
                pos, marker = i, text
        if pos < 0:
            return ""
        if last.response_ids and last.response_ids[-1] in self.stop_texts:
            return turn[pos + len(marker) :]
        return turn[pos:]

    def assistant(
        self,
        text: str,
        tools: list[dict] | None,
        token_ids: Sequence[int] | None = None,
        finish_reason: str = "stop",
    ) -> tuple[str, list[ToolCall], list[str]]:
        """Split the model's text into content and tool calls (only when tools were offered). A
        format whose markers are special tokens parses the turn's `token_ids` decoded with them."""
        if not tools:
            return text, [], []
        if token_ids is not None and getattr(self.format, "special_tokens", False):
            text = raw_turn_text(self.tokenizer, list(token_ids), finish_reason)
        parsed = self.format.parse(text, tools)
        return parsed.content, parsed.calls, parsed.errors


def history_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The assistant message as the client will send it back (template form)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return msg


def cut_at_stop(tokenizer: Any, ids: list[int], stops: Sequence[str]) -> tuple[int, str] | None:
    """Where generation would have stopped had the stop strings been checked after each token:
    the first stop string to be completed ends the turn. Returns (tokens to keep: the fewest whose
    text contains that stop string, the text before it), or None when no stop occurs."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [(full.find(s) + len(s), full.find(s)) for s in stops if s in full]
    if not hits:
        return None
    need, pos = min(hits, key=lambda h: (h[0], h[1]))
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= need:
            hi = mid
        else:
            lo = mid + 1
    return lo, full[:pos]
