"""OpenAI-format response bodies for weir's server: chat and text completions, streamed (SSE) or
whole, with token log-probs, tool calls and usage; and `Choice`, one completion after stop strings.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse

from weir.rollout.tool_calls import ToolCall
from weir.serve.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from weir.serve.app import ServerState

OPENAI_FINISH = {"stop": "stop", "length": "length", "abort": "length"}


@dataclass
class Choice:
    """One completion after stop strings: the tokens kept (and recorded) and their text."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # weir's: stop | length | abort
    text: str
    sampled_logprobs: list[float] | None = None  # under top-k/top-p truncation (see engine.base)


def usage_body(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def sse(chunks: Iterable[dict]) -> AsyncIterator[str]:
    async def gen() -> AsyncIterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return gen()


def token_pieces(tokenizer: Any, ids: list[int], text: str) -> list[str]:
    """Split `text` (the decoded `ids`, possibly cut short) into one piece per token, holding back
    partial UTF-8 characters until they are complete; the pieces join to `text`."""
    out: list[str] = []
    sent = 0
    for k in range(1, len(ids) + 1):
        cur = tokenizer.decode(ids[:k], skip_special_tokens=True)
        end = sent if cur.endswith("\ufffd") else min(len(cur), len(text))
        out.append(text[sent:end] if end > sent else "")
        sent = max(sent, end)
    if out:
        out[-1] += text[sent:]
    return out


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]


def chat_logprobs(state: ServerState, ch: Choice) -> dict[str, Any]:
    content = []
    for tid, lp in zip(ch.token_ids, ch.logprobs, strict=True):
        tok = state.token_text(tid)
        content.append(
            {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
        )
    return {"content": content, "refusal": None}


def finish(ch: Choice, calls: list[ToolCall]) -> str:
    return "tool_calls" if calls else OPENAI_FINISH.get(ch.finish_reason, "stop")


def chat_response(
    state: ServerState,
    req: ChatCompletionRequest,
    prompt_ids: list[int],
    choices: list[Choice],
    parsed: list[tuple[str, list[ToolCall], list[str]]],
):
    rid = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    usage = usage_body(len(prompt_ids), sum(len(c.token_ids) for c in choices))
    return_ids = bool((req.model_extra or {}).get("return_token_ids"))
    if not req.stream:
        out_choices = []
        for i, (ch, (content, calls, _)) in enumerate(zip(choices, parsed, strict=True)):
            message: dict[str, Any] = {
                "role": "assistant",
                "content": content if (content or not calls) else None,
            }
            if calls:
                message["tool_calls"] = tool_calls_json(calls)
            choice: dict[str, Any] = {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(state, ch) if req.logprobs else None,
                "finish_reason": finish(ch, calls),
            }
            if return_ids:
                choice["token_ids"] = ch.token_ids
            out_choices.append(choice)
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": state.model_name,
            "choices": out_choices,
            "usage": usage,
        }
        if return_ids:
            body["prompt_token_ids"] = prompt_ids
        return body

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: Any = None) -> dict:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.model_name,
            "choices": [
                {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            ],
        }

    def chunks() -> Iterable[dict]:
        for i, (ch, (content, calls, _)) in enumerate(zip(choices, parsed, strict=True)):
            yield chunk(i, {"role": "assistant", "content": ""})
            lps = chat_logprobs(state, ch)["content"] if req.logprobs else None
            if calls:
                yield chunk(i, {"content": content}, logprobs={"content": lps} if lps else None)
                calls_delta = [{"index": k, **c} for k, c in enumerate(tool_calls_json(calls))]
                yield chunk(i, {"tool_calls": calls_delta})
            else:
                pieces = token_pieces(state.tokenizer, ch.token_ids, content)
                for k, piece in enumerate(pieces):
                    yield chunk(
                        i, {"content": piece}, logprobs={"content": [lps[k]]} if lps else None
                    )
            yield chunk(i, {}, finish=finish(ch, calls))
        if req.stream_options is not None and req.stream_options.include_usage:
            yield {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": state.model_name,
                "choices": [],
                "usage": usage,
            }

    return StreamingResponse(sse(chunks()), media_type="text/event-stream")


def completion_logprobs(state: ServerState, ch: Choice) -> dict[str, Any]:
    tokens = [state.token_text(t) for t in ch.token_ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": list(ch.logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def completion_response(
    state: ServerState, req: CompletionRequest, prompt_ids: list[int], choices: list[Choice]
):
    rid = "cmpl-" + uuid.uuid4().hex
    created = int(time.time())
    usage = usage_body(len(prompt_ids), sum(len(c.token_ids) for c in choices))
    want_lp = req.logprobs is not None

    def body(choice_list: list[dict], **extra: Any) -> dict:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": choice_list,
            **extra,
        }

    if not req.stream:
        return body(
            [
                {
                    "index": i,
                    "text": ch.text,
                    "logprobs": completion_logprobs(state, ch) if want_lp else None,
                    "finish_reason": OPENAI_FINISH.get(ch.finish_reason, "stop"),
                }
                for i, ch in enumerate(choices)
            ],
            usage=usage,
        )

    def chunks() -> Iterable[dict]:
        for i, ch in enumerate(choices):
            lp = completion_logprobs(state, ch) if want_lp else None
            for k, piece in enumerate(token_pieces(state.tokenizer, ch.token_ids, ch.text)):
                one = (
                    {
                        "tokens": [lp["tokens"][k]],
                        "token_logprobs": [lp["token_logprobs"][k]],
                        "top_logprobs": None,
                        "text_offset": [lp["text_offset"][k]],
                    }
                    if lp
                    else None
                )
                yield body([{"index": i, "text": piece, "logprobs": one, "finish_reason": None}])
            yield body(
                [
                    {
                        "index": i,
                        "text": "",
                        "logprobs": None,
                        "finish_reason": OPENAI_FINISH.get(ch.finish_reason, "stop"),
                    }
                ]
            )
        if req.stream_options is not None and req.stream_options.include_usage:
            yield body([], usage=usage)

    return StreamingResponse(sse(chunks()), media_type="text/event-stream")
