"""Prompt encoding: a data row becomes prompt token ids, through the tokenizer's chat template.

A row carries either a prompt string (under `prompt_key`) or a chat (a list of
``{"role", "content"}`` messages, under ``"messages"`` or under `prompt_key` itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "BadRow",
    "DataError",
    "PromptTooLong",
    "encode_prompt",
    "render_prompt",
    "prompt_messages",
]


class BadRow(ValueError):
    """A data row that cannot become a prompt (missing or empty prompt field, malformed chat).

    Rollout collection skips and counts such rows (`data/skipped_bad_rows`) instead of failing the step.
    """


class DataError(ValueError):
    """Data the run was told not to tolerate (e.g. `data.on_long_prompt=error`); it stops the run."""


class PromptTooLong(BadRow):
    """The encoded prompt is longer than `max_prompt_tokens`; callers skip and count such rows."""

    def __init__(self, num_tokens: int, max_tokens: int, index: Any = None) -> None:
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens
        self.index = index
        where = f"row {index}: " if index is not None else ""
        super().__init__(
            f"{where}prompt has {num_tokens} tokens, more than max_prompt_tokens={max_tokens}"
        )


def prompt_messages(
    row: Mapping[str, Any],
    *,
    prompt_key: str = "prompt",
    system_prompt: str | None = None,
) -> list[dict[str, Any]]:
    """The chat of `row` as a message list, with `system_prompt` prepended unless it has one.

    Raises BadRow for a missing or empty prompt / chat.
    """
    where = f"row {row['_index']}" if "_index" in row else "row"
    value = row.get(prompt_key)
    if value is None and "messages" in row:
        value = row["messages"]
    if value is None and prompt_key in row:
        raise BadRow(f"{where}: the prompt field {prompt_key!r} is null")
    if value is None:
        raise BadRow(
            f"{where} has no prompt: no {prompt_key!r} or 'messages' field; its keys are {sorted(row)}"
        )
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(f"{where}: the prompt {prompt_key!r} is empty")
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, (list, tuple)):
        if not value:
            raise BadRow(f"{where}: the chat (messages) is empty")
        messages = []
        for i, m in enumerate(value):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise BadRow(
                    f"{where}: message {i} must be a dict with 'role' and 'content', got {m!r}"
                )
            messages.append(dict(m))
        if all(not str(m["content"] or "").strip() for m in messages):
            raise BadRow(f"{where}: every message in the chat is empty")
    else:
        raise BadRow(
            f"{where}: the prompt must be a string or a list of messages, got {type(value).__name__}"
        )
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    tokenizer: Any,
    row: Mapping[str, Any],
    *,
    prompt_key: str = "prompt",
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> str:
    """The prompt text the model sees: the chat template with the assistant turn opened
    (``add_generation_prompt=True``), or, without a template, the message contents joined by
    blank lines (a system prompt first)."""
    messages = prompt_messages(row, prompt_key=prompt_key, system_prompt=system_prompt)
    if use_chat_template and _has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(str(m["content"]) for m in messages if str(m["content"] or "").strip())


def encode_prompt(
    tokenizer: Any,
    row: Mapping[str, Any],
    *,
    prompt_key: str = "prompt",
    system_prompt: str | None = None,
    use_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
) -> list[int]:
    """Token ids of the prompt of `row` (see `render_prompt` for the text).

    The chat-template text already holds any BOS the template writes, so it is encoded with
    ``add_special_tokens=False``; plain text is encoded with the tokenizer's special tokens.
    Raises `BadRow` for a missing or empty prompt and `PromptTooLong` (a `BadRow`) when the ids exceed
    `max_prompt_tokens`.
    """
    templated = use_chat_template and _has_chat_template(tokenizer)
    text = render_prompt(
        tokenizer,
        row,
        prompt_key=prompt_key,
        system_prompt=system_prompt,
        use_chat_template=use_chat_template,
    )
    ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
    ids = [int(i) for i in ids]
    if not ids:
        raise BadRow("the prompt encodes to zero tokens")
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise PromptTooLong(len(ids), max_prompt_tokens, row.get("_index"))
    return ids
