"""Tool-call formats of real model families: each parses what its family's chat template writes
for an assistant message's ``tool_calls``, renders the same text back, and survives any text.

The templates (tests/rollout/family_templates.py) are written from each family's public
template; that file says where each came from.
"""

from __future__ import annotations

import asyncio
import json
import string

import family_templates as T
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.utils.chat_template_utils import render_jinja_template

from weir.config.schema import AgentConfig
from weir.rollout.env import ToolEnv
from weir.rollout.multi_turn import run_episode
from weir.rollout.tool_calls import (
    ParsedTurn,
    ToolCall,
    get_tool_format,
    parse_tool_calls,
    raw_turn_text,
    render_tool_calls,
)
from weir.rollout.tool_formats import FORMATS, TOOL_FORMATS

# family format -> (its template, the end-of-turn text after the calls, most calls per message)
FAMILIES = {
    "qwen3": (T.QWEN3, "<|im_end|>\n", 2),
    "qwen2_5": (T.QWEN3, "<|im_end|>\n", 2),
    "hermes": (T.QWEN3, "<|im_end|>\n", 2),
    "qwen3_coder": (T.QWEN3_CODER, "<|im_end|>\n", 2),
    "llama3_json": (T.LLAMA3_JSON, "<|eot_id|>", 1),
    "mistral": (T.MISTRAL, "</s>", 2),
    "deepseek_v3": (T.DEEPSEEK_V3, "<｜end▁of▁sentence｜>", 2),
    "harmony": (T.GPT_OSS, "", 1),
}

CALLS = [
    ToolCall("calc", {"expression": "12*34"}, id="call_0a1b2c3d4e5f"),
    ToolCall(
        "lookup",
        {"city": 'Zürich "old" town', "days": 3, "units": {"temp": "C", "hours": [6, 18]}},
        id="call_9z8y7x6w5v4u",
    ),
]
SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Weather.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "units": {"type": "object"},
                },
            },
        },
    },
]


def render(template: str, messages: list[dict], generation: bool) -> str:
    return render_jinja_template(
        [messages],
        tools=SCHEMAS,
        chat_template=template,
        add_generation_prompt=generation,
        bos_token="<s>",
        eos_token="</s>",
    )[0][0]


def template_turn(fmt: str, calls: list[ToolCall], content: str = "") -> str:
    """What the family's template writes as the assistant's turn with `calls` (after the
    generation prompt, before the end-of-turn marker): the text the model learns to produce."""
    template, end, _ = FAMILIES[fmt]
    user = {"role": "user", "content": "What is 12*34, and the weather?"}
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ],
    }
    full = render(template, [user, message], generation=False)
    before = render(template, [user], generation=True)
    if not full.startswith(before):  # e.g. GPT-OSS re-renders a past call's header
        before = render(template, [user], generation=False)
    assert full.startswith(before)
    turn = full[len(before) :]
    assert turn.endswith(end), (fmt, turn)
    return turn[: len(turn) - len(end)] if end else turn


def same_calls(got: list[ToolCall], want: list[ToolCall], fmt: str) -> None:
    assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in want]
    if fmt == "mistral":  # the template keeps the last 9 characters of each id
        assert [c.id for c in got] == [c.id[-9:] for c in want]


@pytest.mark.parametrize("fmt", sorted(FAMILIES))
def test_each_family_parses_what_its_template_writes_and_renders_it_back(fmt):
    most = FAMILIES[fmt][2]
    for calls in ([CALLS[0]], CALLS[:most], [CALLS[1]]):
        turn = template_turn(fmt, calls)
        parsed = parse_tool_calls(turn, fmt, tools=SCHEMAS)
        assert parsed.errors == [], (fmt, turn)
        same_calls(parsed.calls, calls, fmt)
        assert parsed.content == ""
        rendered = render_tool_calls(calls, fmt)
        if fmt == "harmony":  # the model writes the header in the other order; both parse
            assert rendered.startswith("<|channel|>commentary to=functions.")
            assert turn.startswith(f" to=functions.{calls[0].name}<|channel|>commentary json")
        else:
            assert rendered == turn, fmt
        again = parse_tool_calls(rendered, fmt, tools=SCHEMAS)
        assert again.errors == []
        same_calls(again.calls, calls, fmt)


@pytest.mark.parametrize("fmt", ["qwen3", "qwen3_coder", "deepseek_v3"])
def test_text_before_the_calls_is_the_content(fmt):
    turn = template_turn(fmt, CALLS[:1], content="Let me compute that.")
    parsed = parse_tool_calls(turn, fmt, tools=SCHEMAS)
    assert parsed.content == "Let me compute that." and parsed.errors == []
    same_calls(parsed.calls, CALLS[:1], fmt)


def test_known_shapes_written_by_the_models_themselves():
    """Outputs in the forms the families' own docs and vLLM's parser tests show."""
    harmony = (
        "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.calc <|constrain|>json<|message|>{"expression": "2+2"}'
    )  # the closing <|call|> is the stop token, removed before parsing
    p = parse_tool_calls(harmony, "harmony")
    assert [(c.name, c.arguments) for c in p.calls] == [("calc", {"expression": "2+2"})]
    assert p.content == ""  # the analysis channel is reasoning, not content
    final = (
        "<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>4"
    )
    assert parse_tool_calls(final, "harmony") == ParsedTurn("4", [], [])
    # Mistral v11+ tokenizers: name[ARGS]{json}
    p = parse_tool_calls('[TOOL_CALLS]calc[ARGS]{"expression": "1+1"}', "mistral")
    assert [(c.name, c.arguments) for c in p.calls] == [("calc", {"expression": "1+1"})]
    # DeepSeek-V3.1: name<sep>{json}
    v31 = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calc<｜tool▁sep｜>"
        '{"expression": "3*3"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    p = parse_tool_calls(v31, "deepseek_v3")
    assert [(c.name, c.arguments) for c in p.calls] == [("calc", {"expression": "3*3"})]
    # Llama 3: <|python_tag|> prefix, several calls separated by ';'
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}'
    p = parse_tool_calls(text, "llama3_json")
    assert [(c.name, c.arguments) for c in p.calls] == [("a", {"x": 1}), ("b", {})]
    assert parse_tool_calls("The answer is 4.", "llama3_json") == ParsedTurn("The answer is 4.")


def test_qwen3_coder_types_parameters_by_the_tool_schema():
    text = (
        "<tool_call>\n<function=lookup>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    (call,) = parse_tool_calls(text, "qwen3_coder", tools=SCHEMAS).calls
    assert call.arguments == {"city": "42", "days": 7}  # a string parameter stays text
    (call,) = parse_tool_calls(text, "qwen3_coder").calls  # no schema: JSON where it decodes
    assert call.arguments == {"city": 42, "days": 7}
    flag = (
        "<tool_call>\n<function=f>\n<parameter=on>\nTrue\n</parameter>\n</function>\n</tool_call>"
    )
    schema = [
        {"function": {"name": "f", "parameters": {"properties": {"on": {"type": "boolean"}}}}}
    ]
    assert parse_tool_calls(flag, "qwen3_coder", tools=schema).calls[0].arguments == {"on": True}


@pytest.mark.parametrize(
    "fmt,text,fragment",
    [
        ("qwen3_coder", "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>", "function="),
        ("qwen3_coder", "<tool_call>\n<function=calc>\n<parameter=x>\n1", "unclosed"),
        ("llama3_json", '{"name": "calc", "parameters": {"x": 1}', "not valid JSON"),
        ("llama3_json", '{"parameters": {}}', "no 'name'"),
        ("mistral", '[TOOL_CALLS] [{"name": "calc", "arguments": ', "not valid JSON"),
        ("mistral", "[TOOL_CALLS] hello", "not followed by a call"),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>c",
            "unclosed",
        ),
        (
            "harmony",
            "<|channel|>commentary to=functions.calc json<|message|>{oops",
            "not valid JSON",
        ),
    ],
)
def test_malformed_calls_are_reported_not_raised(fmt, text, fragment):
    parsed = parse_tool_calls(text, fmt)
    assert parsed.calls == [] and len(parsed.errors) == 1 and fragment in parsed.errors[0]


NAMES = st.text(string.ascii_letters + "_", min_size=1, max_size=12)
SCALARS = st.one_of(
    st.integers(-(10**6), 10**6),
    st.text(st.characters(blacklist_characters="<>\x00", blacklist_categories=("Cs",)), max_size=20)
    .map(str.strip)
    .filter(
        lambda s: (
            s
            and not s[0].isdigit()
            and s[0] not in '-[{"'
            and s not in ("True", "False", "None", "null", "true", "false")
        )
    ),
    st.lists(st.integers(0, 99), max_size=3),
)
ARGS = st.dictionaries(NAMES, SCALARS, max_size=3)
CALL_LISTS = st.lists(
    st.builds(
        ToolCall,
        NAMES,
        ARGS,
        st.text(string.ascii_letters + string.digits, min_size=9, max_size=12),
    ),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "tag"])
@settings(max_examples=25, deadline=None)
@given(calls=CALL_LISTS)
def test_parse_inverts_render_for_any_calls(fmt, calls):
    parsed = parse_tool_calls(render_tool_calls(calls, fmt), fmt)
    assert parsed.errors == []
    assert [(c.name, c.arguments) for c in parsed.calls] == [(c.name, c.arguments) for c in calls]


PIECES = list('<>{}[]":;,=|/\n xyz1') + [
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "<parameter=",
    "</parameter>",
    "</function>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<|channel|>",
    "<|message|>",
    "to=functions.",
    "<|constrain|>",
    "<|call|>",
    "<|end|>",
    "<|start|>",
    '{"name": "a", "arguments": ',
]


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=40, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES), max_size=30).map("".join))
def test_no_text_makes_a_parser_raise(fmt, text):
    parsed = parse_tool_calls(text, fmt)
    assert isinstance(parsed, ParsedTurn)
    assert all(isinstance(c.arguments, dict) for c in parsed.calls)


class Bracketed:
    """A plugin format: ``!name(json)``."""

    special_tokens = False

    def parse(self, text, tools=None):
        if not text.startswith("!"):
            return ParsedTurn(text.strip())
        name, _, rest = text[1:].partition("(")
        return ParsedTurn("", [ToolCall(name, json.loads(rest[:-1]))])

    def render(self, calls):
        return "".join(f"!{c.name}({json.dumps(c.arguments)})" for c in calls)


def test_a_plugin_format_is_named_by_dotted_path_and_unknown_names_list_the_valid_ones():
    fmt = get_tool_format(f"{__name__}:Bracketed")
    assert isinstance(fmt, Bracketed)
    assert (
        parse_tool_calls('!calc({"expression": "1"})', f"{__name__}:Bracketed").calls[0].name
        == "calc"
    )
    with pytest.raises(ValueError, match="valid names are") as err:
        get_tool_format("qwen4")
    assert "qwen3_coder" in str(err.value)
    with pytest.raises(ValueError, match="parse"):
        get_tool_format("json:dumps")
    assert set(TOOL_FORMATS) >= {
        "hermes",
        "tag",
        "qwen3",
        "qwen3_coder",
        "llama3_json",
        "mistral",
        "deepseek_v3",
        "harmony",
    }


def test_the_agent_config_refuses_an_unknown_format_at_start():
    from weir.config import build_config
    from weir.rollout.multi_turn import agent_extras

    cfg = build_config({"agent": {"tool_format": "qwen4"}})
    with pytest.raises(ValueError, match="agent.tool_format"):
        agent_extras(cfg)


def test_formats_with_special_token_markers_are_parsed_from_the_raw_turn():
    """A turn is decoded without special tokens for the reward; a format whose markers are special
    tokens (Mistral's [TOOL_CALLS], harmony's <|channel|>) gets the raw text instead, less the
    closing stop token. weir's tiny tokenizer has special tokens (<|tool|>, <|end|>) to show it."""
    from test_multi_turn import ROW, TOK, ScriptedEngine, make_ctx

    class SpecialTagged:
        special_tokens = True

        def parse(self, text, tools=None):
            if text.startswith("<|tool|>"):
                return ParsedTurn("", [ToolCall("mul", {"a": 6, "b": 7})])
            return ParsedTurn(text)

        def render(self, calls):
            return "<|tool|>"

    assert (
        raw_turn_text(TOK, TOK("<|tool|>x<|end|>", add_special_tokens=False)["input_ids"])
        == "<|tool|>x"
    )
    env = ToolEnv(["test_multi_turn:mul"], SpecialTagged())
    assert env.raw_action
    agent = AgentConfig(max_turns=2)
    engine = ScriptedEngine(["<|tool|>call", "42"])
    s = asyncio.run(run_episode(make_ctx(engine, agent), ROW, env, agent))
    assert s.reward_info["tool_calls"] == 1 and s.reward_info["malformed_calls"] == 0
    assert TOK.decode(s.response_ids).startswith("<|tool|>call<|end|><|tool|>42<|end|>")
