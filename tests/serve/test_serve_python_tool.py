"""The sandboxed `python` tool through the OpenAI-compatible server: the model's call comes back as
`tool_calls`, the agent runs it in the sandbox, and the output goes back as the tool turn."""

from __future__ import annotations

import asyncio
import json

import openai

from weir.rollout.tool_calls import ToolCall
from weir.rollout.tools import ToolRegistry, call_tool
from weir.sandbox.tool import python

CODE = "print(sum(i * i for i in range(10)))"
CALL = (
    '<tool_call>\n{"name": "python", "arguments": {"code": ' + json.dumps(CODE) + "}}\n</tool_call>"
)


def test_python_tool_round_trip_through_the_server(scripted):
    engine, server = scripted
    engine.replies = [CALL, "It is 285."]
    session = server.sessions.open()
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    tools = ToolRegistry([python])
    messages = [{"role": "user", "content": "Sum of squares below 10?"}]
    r1 = client.chat.completions.create(model="weir", messages=messages, tools=tools.schemas())
    (call,) = r1.choices[0].message.tool_calls
    assert call.function.name == "python" and json.loads(call.function.arguments) == {"code": CODE}
    result = asyncio.run(
        call_tool(tools, ToolCall(call.function.name, json.loads(call.function.arguments)))
    )
    assert result.ok and result.content == "285"
    messages += [
        r1.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": result.content},
    ]
    r2 = client.chat.completions.create(model="weir", messages=messages, tools=tools.schemas())
    assert r2.choices[0].message.content == "It is 285."
    sample = session.to_sample()
    # the tool's output is not the policy's: its tokens are masked out of the loss
    tool_ids = engine.tokenizer("285", add_special_tokens=False)["input_ids"]
    mask_at = [
        sample.loss_mask[i]
        for i in range(len(sample.response_ids) - len(tool_ids) + 1)
        if sample.response_ids[i : i + len(tool_ids)] == tool_ids
    ]
    assert 0 in mask_at and 1 in mask_at  # the tool turn (masked) and the model's answer (trained)
