"""What an environment shows the model: text, images, or both.

An environment's ``reset`` and ``step`` may return, besides a plain string, an `Observation`
(text and images) or a list of chat content parts in the OpenAI or Hugging Face form::

    Observation(text="Goal: log in as ada", images=[screen])          # a PIL image, path, data URL
    [{"type": "image", "image": screen}, {"type": "text", "text": "Goal: ..."}]

An environment that answers as chat messages (a user reply, several tool results) returns
`ChatMessages`; the chat template renders them as those messages, each in its own role's layout
(`weir.rollout.multi_turn.encode_messages`).

An image is any reference `weir.data.vision.load_image` reads (a PIL image, a file path, a
``data:image/...;base64,`` URL, bytes, an HF `datasets` Image dict). An `Observation`'s images come
before its text. `summary` is the text that stands in for its images once the episode's image memory
drops them (``vision.episode_memory: summary``, `weir.rollout.vision_episode`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Observation", "ChatMessages", "as_observation", "content_parts"]


@dataclass
class Observation:
    """Text and images shown to the model in one turn (images first, then the text)."""

    text: str = ""
    images: list[Any] = field(default_factory=list)
    summary: str | None = None
    """Stands in for this observation's images when the episode's image memory drops them (null:
    `vision.image_placeholder`)."""

    def parts(self) -> list[dict[str, Any]]:
        """The observation as Hugging Face chat content parts."""
        out: list[dict[str, Any]] = [{"type": "image", "image": img} for img in self.images]
        if self.text:
            out.append({"type": "text", "text": self.text})
        return out


@dataclass
class ChatMessages:
    """Chat messages shown to the model in one turn, each ``{"role": "user" | "tool" | "system",
    "content": str}`` (more keys, such as ``tool_call_id``, pass to the chat template). An empty
    list shows nothing but the next assistant header."""

    messages: list[dict[str, Any]]


def as_observation(
    value: Any, where: str = "observation"
) -> Observation | ChatMessages | str | None:
    """`value` as what the episode appends: None, a string (text only), or an `Observation`.

    A list of content parts becomes an `Observation` (its texts joined in order, its images kept in
    order; a list holding only text is a string). Anything else raises TypeError naming `where`.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, ChatMessages):
        for m in value.messages:
            if not (
                isinstance(m, Mapping)
                and m.get("role") in ("user", "tool", "system")
                and isinstance(m.get("content"), str)
            ):
                raise TypeError(
                    f"{where}: a message must be {{'role': 'user' | 'tool' | 'system', "
                    f"'content': str}}, got {m!r:.200}"
                )
        return value
    if isinstance(value, Observation):
        if not isinstance(value.text, str) or not isinstance(value.images, list):
            raise TypeError(f"{where}: Observation(text=str, images=list), got {value!r:.200}")
        return value if value.images else value.text
    if isinstance(value, list):
        texts, images = [], []
        for part in value:
            if not isinstance(part, Mapping) or "type" not in part:
                raise TypeError(f"{where}: a content part must be a dict with 'type', got {part!r}")
            if part["type"] == "text":
                texts.append(str(part.get("text", "")))
            elif part["type"] in ("image", "image_url"):
                ref = _image_ref(part)
                if ref is None:
                    raise TypeError(f"{where}: an image part without an image: {dict(part)!r}")
                if texts:
                    raise TypeError(
                        f"{where}: put an observation's images before its text (an image after "
                        "text is not supported)"
                    )
                images.append(ref)
            else:
                raise TypeError(f"{where}: unsupported content part type {part['type']!r}")
        text = "".join(texts)
        return Observation(text, images) if images else text
    raise TypeError(
        f"{where} must be a str, an Observation or a list of content parts, got "
        f"{type(value).__name__}"
    )


def content_parts(obs: Observation | str) -> list[dict[str, Any]] | str:
    """Chat-message content for `obs`: the string itself, or its parts."""
    return obs if isinstance(obs, str) else obs.parts()


def _image_ref(part: Mapping[str, Any]) -> Any:
    if part["type"] == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, Mapping) else url
    for key in ("image", "path", "url"):
        if part.get(key) is not None:
            return part[key]
    return None
