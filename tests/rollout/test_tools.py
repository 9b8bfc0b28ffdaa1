"""Tool calls (parse / render), tool schemas from signatures, contained tool execution, templates."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.rollout.tool_calls import (
    ParsedTurn,
    ToolCall,
    parse_tool_calls,
    render_tool_calls,
)
from weir.rollout.tools import ToolRegistry, call_tool, call_tool_sync, tool_schema
from weir.tasks.tiny_model import build_tokenizer

# ------------------------------------------------------------------------------------ parsing


def test_hermes_calls_and_content_are_separated():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calc", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"weir\\"}"}</tool_call>'
    )
    turn = parse_tool_calls(text)
    assert turn.content == "Let me compute."
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("calc", {"expression": "12*34"}),
        ("search", {"q": "weir"}),  # OpenAI-style string arguments are decoded
    ]
    assert turn.errors == [] and turn.calls[0].id != turn.calls[1].id


@pytest.mark.parametrize(
    "body, fragment",
    [
        ("{not json}", "not valid JSON"),
        ('["calc"]', "JSON object"),
        ('{"arguments": {}}', "no 'name'"),
        ('{"name": "calc", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "calc", "arguments": "nope"}', "not JSON"),
    ],
)
def test_malformed_hermes_calls_are_reported_not_raised(body, fragment):
    turn = parse_tool_calls(f"a <tool_call>{body}</tool_call> b")
    assert turn.calls == [] and len(turn.errors) == 1 and fragment in turn.errors[0]
    assert turn.content == "a  b"


def test_an_unclosed_final_hermes_call_is_accepted_if_its_json_is_complete():
    ok = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert [(c.name, c.arguments) for c in ok.calls] == [("f", {"x": 1})] and not ok.errors
    cut = parse_tool_calls('<tool_call>{"name": "f", "argu')
    assert not cut.calls and "unclosed <tool_call>" in cut.errors[0]


def test_tag_format_plain_and_json_bodies():
    turn = parse_tool_calls("x <calc>12*34</calc> y <b>bold</b>", "tag", tools=["calc"])
    assert [(c.name, c.arguments) for c in turn.calls] == [("calc", {"input": "12*34"})]
    assert turn.content == "x  y <b>bold</b>"  # unknown tags stay text when tools are named
    js = parse_tool_calls('<mul>{"a": 2, "b": 3}</mul>', "tag")
    assert js.calls[0].arguments == {"a": 2, "b": 3}
    bad = parse_tool_calls("<calc>12*", "tag", tools=["calc"])
    assert bad.calls == [] and bad.errors == ["unclosed <calc> (missing </calc>)"]
    assert parse_tool_calls("<think>hm</think>42", "tag").calls == []  # reserved tags


def test_unknown_format_is_a_clear_error():
    with pytest.raises(ValueError, match="hermes"):
        parse_tool_calls("x", "xml")


_names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_args = st.dictionaries(st.text(min_size=1, max_size=6), _json, max_size=3)


@settings(max_examples=150, deadline=None)
@given(
    calls=st.lists(st.tuples(_names, _args), min_size=1, max_size=3),
    fmt=st.sampled_from(["hermes", "tag"]),
)
def test_render_then_parse_returns_the_same_calls(calls, fmt):
    objs = [ToolCall(name, args) for name, args in calls]
    if fmt == "tag":  # a tag body that is plain text must not look like JSON or hold the close tag
        objs = [c for c in objs if c.name not in ("think", "answer")]
    text = render_tool_calls(objs, fmt)
    turn = parse_tool_calls(text, fmt)
    assert turn.errors == []
    assert [(c.name, c.arguments) for c in turn.calls] == [(c.name, c.arguments) for c in objs]


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=60))
def test_parsing_any_text_never_raises(text):
    for fmt in ("hermes", "tag"):
        turn = parse_tool_calls(text, fmt)
        assert isinstance(turn, ParsedTurn)
        assert isinstance(parse_tool_calls(text, fmt, tools=["calc"]), ParsedTurn)


# ------------------------------------------------------------------------------------ schemas


def search(query: str, limit: int = 5, mode: Literal["fast", "exact"] = "fast") -> list[str]:
    """Search the index.

    Args:
        query: what to look for.
        limit: the most results
            to return.
    """
    return [query] * limit


def test_schema_from_signature_and_docstring():
    schema = tool_schema(search)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "search" and fn["description"] == "Search the index."
    params = fn["parameters"]
    assert params["type"] == "object" and params["required"] == ["query"]
    assert params["properties"]["query"] == {"type": "string", "description": "what to look for."}
    assert params["properties"]["limit"] == {
        "type": "integer",
        "default": 5,
        "description": "the most results to return.",
    }
    assert params["properties"]["mode"]["enum"] == ["fast", "exact"]
    assert "title" not in json.dumps(schema)


def test_a_schema_is_built_once_per_function_and_each_caller_gets_its_own_copy(monkeypatch):
    """A multi-turn rollout builds an environment and renders its tools for every episode: the
    schema (and the argument validator) come from pydantic once per function, not per episode."""
    import pydantic

    from weir.rollout import tools

    def lookup(key: str, n: int = 1) -> str:
        """Look a key up."""
        return key * n

    built = {"schema": 0, "validator": 0}
    adapter, validate = pydantic.TypeAdapter, pydantic.validate_call

    def counting_adapter(*a, **k):
        built["schema"] += 1
        return adapter(*a, **k)

    def counting_validate(*a, **k):
        built["validator"] += 1
        return validate(*a, **k)

    monkeypatch.setattr(tools.pydantic, "TypeAdapter", counting_adapter)
    monkeypatch.setattr(tools.pydantic, "validate_call", counting_validate)
    first = tool_schema(lookup)
    first["function"]["parameters"]["properties"]["key"]["type"] = "changed by a caller"
    for _ in range(20):
        registry = ToolRegistry([lookup])
        assert registry.schemas()[0]["function"]["parameters"]["properties"]["key"] == {
            "type": "string"
        }
        assert call_tool_sync(registry, ToolCall("lookup", {"key": "ab", "n": "2"})).content == (
            "abab"
        )
    assert built == {"schema": 1, "validator": 1}


def test_tools_bound_to_an_episodes_objects_are_not_kept_alive():
    """A tool that is a method of an episode's object (or a closure over one) may hold a sandbox or a
    connection: nothing built from it outlives the episode."""
    import gc
    import weakref

    class Session:
        def lookup(self, key: str) -> str:
            """Look a key up."""
            return key

    session = Session()
    registry = ToolRegistry({"lookup": session.lookup})
    assert registry.schemas()[0]["function"]["name"] == "lookup"
    assert call_tool_sync(registry, ToolCall("lookup", {"key": "a"})).content == "a"
    alive = weakref.ref(session)
    del session, registry
    gc.collect()
    assert alive() is None


def test_registry_resolves_dotted_paths_and_checks_names():
    reg = ToolRegistry(["weir.tasks.calculator:calc", search])
    assert reg.names == ["calc", "search"] and "calc" in reg and len(reg) == 2
    assert [s["function"]["name"] for s in reg.schemas()] == ["calc", "search"]
    with pytest.raises(ValueError, match="tool"):
        ToolRegistry(["weir.tasks.calculator:no_such_tool"])


# ------------------------------------------------------------------------------------ calling


def _run(reg, call, **kw):
    return asyncio.run(call_tool(reg, call, **kw))


def test_calls_validate_and_coerce_arguments():
    reg = ToolRegistry([search])
    r = _run(reg, ToolCall("search", {"query": "w", "limit": "2"}))
    assert r.ok and json.loads(r.content) == ["w", "w"]
    bad = _run(reg, ToolCall("search", {"query": "w", "limit": "many"}))
    assert not bad.ok and bad.error_kind == "bad_arguments" and "limit" in bad.content
    extra = _run(reg, ToolCall("search", {"query": "w", "colour": 1}))
    assert not extra.ok and extra.error_kind == "bad_arguments"
    unknown = _run(reg, ToolCall("find", {}))
    assert unknown.error_kind == "unknown_tool" and "search" in unknown.content


def test_tag_input_binds_to_the_single_required_parameter():
    reg = ToolRegistry(["weir.tasks.calculator:calc", search])
    assert _run(reg, ToolCall("calc", {"input": "12*34"})).content == "408"
    assert json.loads(_run(reg, ToolCall("search", {"input": "q"})).content) == ["q"] * 5


def test_exceptions_and_timeouts_become_error_results_sync_and_async():
    def boom() -> str:
        """Fails."""
        raise ZeroDivisionError("nope")

    def slow() -> str:
        """Sleeps."""
        time.sleep(1)
        return "late"

    async def aslow() -> str:
        """Sleeps without blocking."""
        await asyncio.sleep(1)
        return "late"

    reg = ToolRegistry([boom, slow, aslow])
    r = _run(reg, ToolCall("boom", {}))
    assert (r.ok, r.error_kind) == (False, "exception") and "ZeroDivisionError: nope" in r.content

    async def timed(name):
        start = time.perf_counter()
        r = await call_tool(reg, ToolCall(name, {}), timeout_s=0.1)
        return r, time.perf_counter() - start

    for name in ("slow", "aslow"):
        r, seconds = asyncio.run(timed(name))  # the caller gets control back at the timeout
        assert r.error_kind == "timeout" and seconds < 0.8
        r = call_tool_sync(reg, ToolCall(name, {}), timeout_s=0.1)
        assert r.error_kind == "timeout"
    assert call_tool_sync(reg, ToolCall("boom", {})).error_kind == "exception"


# ------------------------------------------------------------------------------------ template


@pytest.mark.hf_compat  # also run against the oldest supported transformers
def test_tiny_chat_template_renders_system_tools_calls_and_results():
    tok = build_tokenizer()
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "12*34?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calc", "arguments": '{"expression": "12*34"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "408"},
        {"role": "assistant", "content": "408"},
    ]
    calc_schema = ToolRegistry(["weir.tasks.calculator:calc"]).schemas()
    text = tok.apply_chat_template(chat, tools=calc_schema, tokenize=False)
    call = render_tool_calls([ToolCall("calc", {"expression": "12*34"})])
    assert text == (
        "<|system|>Be brief.\ntools:\ncalc(expression): Evaluate an arithmetic expression exactly.<|end|>"
        f"<|user|>12*34?<|end|><|assistant|>{call}<|end|><|tool|>408<|end|><|assistant|>408<|end|>"
    )
    # the parser reads back what the template wrote
    assistant = text.split("<|assistant|>")[1].removesuffix("<|end|><|tool|>408<|end|>")
    assert parse_tool_calls(assistant).calls[0].arguments == {"expression": "12*34"}
    # without tools or a system message the template is the old one, token ids unchanged
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "1+1"}], tokenize=False, add_generation_prompt=True
    )
    assert plain == "<|user|>1+1<|end|><|assistant|>"
    assert tok.convert_tokens_to_ids(
        ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
    ) == list(range(6))
