"""Tool calls through the OpenAI API, with a scripted engine so that the model's turns are known:
`tool_calls` come back parsed, the tool results are appended as non-policy tokens, and the
trajectory is exactly the tokenization of the whole conversation."""

from __future__ import annotations

import json

import openai
import pytest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _enc(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _client(session):
    return openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


def test_tool_call_round_trip_records_the_whole_conversation(scripted, tokenizer):
    engine, server = scripted
    engine.replies = [CALL, "2+3 is 5."]
    session = server.sessions.open()
    client = _client(session)
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    r1 = client.chat.completions.create(model="weir", messages=messages, tools=TOOLS, logprobs=True)
    c1 = r1.choices[0]
    assert c1.finish_reason == "tool_calls"
    assert c1.message.content is None
    (call,) = c1.message.tool_calls
    assert call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    lps1 = [x.logprob for x in c1.logprobs.content]

    messages.append(c1.message)  # the usual agent idiom: append the returned message object
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    pieces, lps2, finish = [], [], None
    stream = client.chat.completions.create(
        model="weir", messages=messages, tools=TOOLS, logprobs=True, stream=True
    )
    for chunk in stream:
        c = chunk.choices[0]
        pieces.append(c.delta.content or "")
        lps2 += [x.logprob for x in (c.logprobs.content if c.logprobs else [])]
        finish = c.finish_reason or finish
    assert "".join(pieces) == "2+3 is 5."
    assert finish == "stop"

    sample = session.to_sample()
    # Independently: the template's rendering of the finished conversation, tokenized in one go.
    final = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
            ],
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "2+3 is 5."},
    ]
    rendered = tokenizer.apply_chat_template(final, tools=TOOLS, tokenize=False)
    assert sample.prompt_ids + sample.response_ids == _enc(tokenizer, rendered)

    r1_ids = _enc(tokenizer, CALL) + [tokenizer.eos_token_id]
    tool_ids = _enc(tokenizer, "<|tool|>5<|end|><|assistant|>")
    r2_ids = _enc(tokenizer, "2+3 is 5.") + [tokenizer.eos_token_id]
    assert sample.response_ids == r1_ids + tool_ids + r2_ids
    assert sample.loss_mask == [1] * len(r1_ids) + [0] * len(tool_ids) + [1] * len(r2_ids)
    assert sample.rollout_logprobs == pytest.approx(lps1 + [0.0] * len(tool_ids) + lps2)
    assert sample.versions == [7] * len(r1_ids) + [-1] * len(tool_ids) + [7] * len(r2_ids)
    # ...and the engine was given exactly the trajectory's prefix at the second turn.
    assert engine.prompts[1] == sample.prompt_ids + r1_ids + tool_ids


def test_stop_string_cuts_the_turn_and_the_template_closes_it(scripted, tokenizer):
    engine, server = scripted
    engine.replies = ["It is 5. More text", "Sure."]
    session = server.sessions.open()
    client = _client(session)
    messages = [{"role": "user", "content": "2+3?"}]
    r1 = client.chat.completions.create(
        model="weir", messages=messages, stop=["."], extra_body={"return_token_ids": True}
    )
    assert r1.choices[0].message.content == "It is 5"
    assert r1.choices[0].finish_reason == "stop"
    assert r1.choices[0].token_ids == _enc(tokenizer, "It is 5.")  # up to the stop, no further

    messages += [
        {"role": "assistant", "content": "It is 5"},
        {"role": "user", "content": "thanks"},
    ]
    client.chat.completions.create(model="weir", messages=messages)
    sample = session.to_sample()
    # The model never emitted <|end|> in turn 1, so the template's marker is a non-policy token.
    added = _enc(tokenizer, "<|end|><|user|>thanks<|end|><|assistant|>")
    r2 = _enc(tokenizer, "Sure.") + [tokenizer.eos_token_id]
    assert sample.response_ids == _enc(tokenizer, "It is 5.") + added + r2
    assert sample.loss_mask == [1] * 8 + [0] * len(added) + [1] * len(r2)


def test_tool_choice_none_returns_the_raw_text(scripted):
    engine, server = scripted
    engine.replies = [CALL]
    session = server.sessions.open()
    r = _client(session).chat.completions.create(
        model="weir",
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
        tool_choice="none",
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == CALL
    assert r.choices[0].finish_reason == "stop"
