"""Chat requests with images -> engine prompt ids and pixels, linked token-exactly to the session's
previous turn.

The same linking as `weir.serve.chat.ChatFormatter` (the previous prompt + response ids, the
template's end-of-turn text the model did not emit, then the new messages), with the images of the
new messages: the text of the new messages is rendered by the chat template (an image part is the
template's placeholder) and expanded by the model's processor, with the new images only, into the
model's image tokens and pixels. The prompt's pixels are the previous turn's followed by the new
ones, so a session's latest turn holds every image of its segment: `weir.serve.trajectory` gives a
segment's sample those pixels. A first call, or one that does not extend the previous turn (the
agent edited its history, or changed an image), is encoded whole and starts a new segment.

Images are OpenAI ``image_url`` parts whose URL is a ``data:image/...;base64,`` URL (remote URLs
only when the server allows them, `vision.allow_remote_urls`).
"""

from __future__ import annotations

import json
from typing import Any

from weir.data.prompts import BadRow
from weir.data.vision import VisionInputs, process_vision_text, vision_messages
from weir.data.vision_spans import concat_vision
from weir.serve.chat import ChatFormatter, Prompt
from weir.serve.protocol import ChatMessage
from weir.serve.trajectory import Turn

__all__ = ["VisionChatFormatter", "chat_dicts"]


def chat_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat-template dicts, keeping content parts (images as ``image_url`` parts)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        if isinstance(m.content, list):
            d["content"] = [p.model_dump(exclude_none=True) for p in m.content]
        else:
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
        for key in ("tool_call_id", "name"):
            if getattr(m, key) is not None:
                d[key] = getattr(m, key)
        out.append(d)
    return out


def _key(m: dict[str, Any]) -> str:
    """What must match for a message to count as the same turn: role, text and images, calls."""
    content = m.get("content") or ""
    if isinstance(content, str):
        content = content.strip()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()]
    return json.dumps([m["role"], content, calls], sort_keys=True, default=str)


class VisionChatFormatter(ChatFormatter):
    """`ChatFormatter` for a vision-language model: `prompt` also returns the pixels."""

    message_key = staticmethod(_key)

    def __init__(self, processor: Any, stop_ids: list[int], tool_format: str, allow_remote: bool):
        super().__init__(processor.tokenizer, stop_ids, tool_format)
        self.processor = processor
        self.allow_remote = allow_remote

    def vision_prompt(
        self, chat: list[dict[str, Any]], tools: list[dict] | None, last: Turn | None
    ) -> tuple[Prompt, VisionInputs | None]:
        """The engine prompt and pixels for `chat` (from `chat_dicts`), linked to `last` when it
        can be. Raises BadRow for an unreadable or refused image."""
        reduced, images, refs = self._reduce(chat)
        text = self.render(reduced, tools, generation=True)
        if last is not None:
            why = self._mismatch(chat, tools, last)
            if why is None:
                n = len(last.messages or [])
                history = reduced[:n]
                before = self.render(history, tools, generation=False)
                closing = self._closing(last, history, tools)
                if closing is not None and text.startswith(before):
                    seen = sum(_images(m) for m in chat[:n])
                    added, vision = self._process(
                        closing + text[len(before) :], images[seen:], refs[seen:]
                    )
                    if added:
                        return (
                            Prompt(last.context + added, "extend"),
                            concat_vision([last.vision, vision]),
                        )
                why = "the chat template does not render the new history as an extension of the old"
            ids, vision = self._process(text, images, refs)
            return Prompt(ids, f"new: {why}"), vision
        ids, vision = self._process(text, images, refs)
        return Prompt(ids, "start"), vision

    def _reduce(self, chat: list[dict[str, Any]]) -> tuple[list[dict], list[Any], list[str]]:
        try:
            return vision_messages({"messages": chat}, allow_remote=self.allow_remote)
        except BadRow as err:
            raise BadRow(str(err).removeprefix("row, ")) from None

    def _process(
        self, text: str, images: list[Any], refs: list[str]
    ) -> tuple[list[int], VisionInputs | None]:
        return process_vision_text(self.processor, text, images, refs, add_special_tokens=False)


def _images(message: dict[str, Any]) -> int:
    content = message.get("content")
    if not isinstance(content, list):
        return 0
    return sum(
        1 for p in content if isinstance(p, dict) and p.get("type") in ("image", "image_url")
    )
