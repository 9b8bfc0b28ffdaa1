"""Workload C of benchmarks/vs_trl.py matches weir's and TRL's multi-turn episodes piece by piece:
the tool, the tool-call parsing (weir's tag parser against the response template TRL is given),
the prompt with its tool list, the observation ids, and the counts both sides report."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.rollout.multi_turn import observation_codec
from weir.rollout.tool_calls import parse_tool_calls
from weir.rollout.tools import ToolRegistry
from weir.tasks import calculator
from weir.tasks.tiny_model import build_tokenizer

PATH = Path(__file__).parents[2] / "benchmarks" / "trl_workloads.py"


@pytest.fixture(scope="module")
def twl():
    spec = importlib.util.spec_from_file_location("trl_workloads", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["trl_workloads"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["trl_workloads"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@settings(max_examples=60, deadline=None)
@given(a=st.integers(-999, 9999), b=st.integers(-999, 9999), op=st.sampled_from("+-*"))
def test_calc_gives_weirs_calculator_result(twl, a, b, op):
    expr = f"{a}{op}({b})"
    assert twl.calc(expr) == calculator.calc(expr) == str(eval(expr))


@pytest.mark.parametrize("bad", ["2**3", "__import__('os')", "1/2", "47*86<|end|>", "1.5*2"])
def test_calc_refuses_what_it_does_not_evaluate(twl, bad):
    with pytest.raises((ValueError, SyntaxError)):
        twl.calc(bad)


_pieces = st.one_of(
    st.text(alphabet="abc xyz=.,", max_size=6),
    st.builds(lambda a, b: f"<calc>{a}*{b}</calc>", st.integers(2, 99), st.integers(2, 99)),
)


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(_pieces, min_size=1, max_size=4))
def test_trl_template_and_weir_parser_find_the_same_calls(twl, tok, parts):
    """A model turn's calls as TRL parses them (the tokenizer's `parse_response` with the response
    template and the rendered prompt as prefix, as TRL's tool loop calls it) are the calls weir's
    ToolEnv runs: same tool, same expression, same order."""
    tok.response_template = twl.CALC_RESPONSE_TEMPLATE
    turn = "".join(parts)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "47*86"}], tools=[twl.calc], add_generation_prompt=True
    )
    ids = tok(turn + "<|end|>", add_special_tokens=False)["input_ids"]
    parsed = tok.parse_response(ids, prefix=prompt, tools=[twl.calc])
    theirs = [
        (c["function"]["name"], c["function"]["arguments"]["expression"])
        for c in parsed.get("tool_calls", [])
    ]
    mine = [
        (c.name, c.arguments["input"]) for c in parse_tool_calls(turn, "tag", tools=["calc"]).calls
    ]
    assert theirs == mine
    if not mine:
        assert parsed.get("content", "").strip() == turn.strip()


def test_prompt_lists_the_tool_alike_for_trl_weir_and_sft(twl, tok):
    user = [{"role": "user", "content": "47*86"}]
    trl = tok.apply_chat_template(
        user, tools=[twl.calc], tokenize=False, add_generation_prompt=True
    )
    weir = tok.apply_chat_template(
        user, tools=ToolRegistry([twl.calc]).schemas(), tokenize=False, add_generation_prompt=True
    )
    system = twl.tools_system_text(tok)
    assert system == "tools:\ncalc(expression): Evaluate arithmetic exactly."
    sft_row = twl.with_tools_system({"prompt": "47*86", "response": "x"}, system)
    sft = tok.apply_chat_template(sft_row["messages"], tokenize=False, add_generation_prompt=True)
    assert trl == weir == sft == f"<|system|>{system}<|end|><|user|>47*86<|end|><|assistant|>"
    chat = [*user, {"role": "assistant", "content": "<calc>47*86</calc>"}]
    row = twl.with_tools_system({"messages": chat, "response": "4042"}, system)
    assert row["messages"][0] == {"role": "system", "content": system}
    assert row["messages"][1:] == chat and row["response"] == "4042"


def test_observation_ids_are_the_same_tool_turn_on_both_sides(tok):
    """weir's observation codec and the suffix TRL 1.16 takes for a tool result (render
    [user, assistant with a call] and then with the tool message and the generation prompt, cut
    after the prefix's last EOS: `GRPOTrainer._get_tool_suffix_ids`) are the same ids."""
    call = {"type": "function", "function": {"name": "calc", "arguments": {}}}
    prefix_msgs = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    prefix = tok.apply_chat_template(prefix_msgs, tokenize=True, return_dict=False)
    full = tok.apply_chat_template(
        [*prefix_msgs, {"role": "tool", "name": "calc", "content": "4042"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    last_eos = max(i for i, t in enumerate(prefix) if t == tok.eos_token_id)
    assert full[: last_eos + 1] == prefix[: last_eos + 1]
    trl_suffix = full[last_eos + 1 :]
    assert trl_suffix == observation_codec(tok).encode("4042")
    assert tok.decode(trl_suffix) == "<|tool|>4042<|end|><|assistant|>"


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_episode_counts_and_reward_of_a_tool_episode(twl, tok):
    turn1, obs, turn2 = (
        "<calc>47*86</calc><|end|>",
        "<|tool|>4042<|end|><|assistant|>",
        "4042<|end|>",
    )
    ids = _enc(tok, turn1 + obs + turn2)
    counter = twl.EpisodeCounter(tok)
    counter.add(12, ids)
    counter.add(10, _enc(tok, "4142<|end|>"))  # a guess: one turn, no call
    bad = "<calc>47*<|end|><|tool|>error: unclosed<|end|><|assistant|>"
    counter.add(12, _enc(tok, bad + "<calc>47*86</calc><|end|>"))  # an error, then a call cut off
    assert counter.rows[0] == {
        "prompt_tokens": 12.0,
        "model_tokens": 18.0 + 1 + 4 + 1,  # byte tokens of the call, <|end|>, the answer, <|end|>
        "obs_tokens": 1 + 4 + 2,
        "turns": 2.0,
        "tool_calls": 1.0,
        "tool_errors": 0.0,
    }
    assert counter.rows[2] == {
        "prompt_tokens": 12.0,
        "model_tokens": 10.0 + 18 + 1,
        "obs_tokens": 1 + 15 + 2,  # <|tool|>, "error: unclosed", <|end|><|assistant|>
        "turns": 2.0,
        "tool_calls": 2.0,
        "tool_errors": 1.0,
    }
    assert counter.means() == {
        "prompt_tokens": 34 / 3,
        "model_tokens": (24 + 5 + 29) / 3,
        "obs_tokens": (7 + 0 + 18) / 3,
        "turns": 5 / 3,
        "tool_calls": 1.0,
        "tool_errors": 1 / 3,
    }
    single = twl.EpisodeCounter(tok, multi_turn=False)  # workload B: writes on past <|end|>
    single.add(10, _enc(tok, "41<|end|><|tool|>42<|end|><|assistant|>x"))
    assert single.rows[0] == {
        "prompt_tokens": 10.0,
        "model_tokens": 2 + 1 + 1 + 2 + 1 + 1 + 1.0,
        "obs_tokens": 0.0,
        "turns": 1.0,
        "tool_calls": 0.0,
        "tool_errors": 0.0,
    }
    assert twl.final_turn_text(tok.decode(ids)) == "4042"
    assert twl.final_turn_text("4042<|end|><|system|><|system|>") == "4042"  # workload B's tail
    assert twl.final_turn_text(turn1 + obs + "<calc>1*2</calc><|end|>") == "<calc>1*2</calc>"


@settings(max_examples=80, deadline=None)
@given(
    turns=st.lists(st.lists(st.integers(10, 20), max_size=5), min_size=1, max_size=4),
    obs=st.lists(st.lists(st.integers(10, 20), max_size=3), max_size=3),
    cut=st.integers(0, 40),
)
def test_split_episode_recovers_turns_and_observations(twl, turns, obs, cut):
    """Ids built as turn <end> [<tool> obs.. <assistant>] turn <end> ...: the split gives back the
    turns and the observations; any prefix of an episode splits into model turns and observations
    that concatenate back to it."""
    end, tool, asst = 1, 5, 4
    ids, want_obs = [], []
    for i, t in enumerate(turns):
        ids += [*t, end]
        if i < len(turns) - 1:
            want_obs.append([tool, *(obs[i] if i < len(obs) else []), asst])
            ids += want_obs[-1]
    got = twl.split_episode(ids, end, tool, asst)
    assert got["turns"] == [[*t, end] for t in turns]
    assert got["observations"] == want_obs
    part = twl.split_episode(ids[:cut], end, tool, asst)
    n_turns, n_obs = len(part["turns"]), len(part["observations"])
    assert n_obs in (max(n_turns - 1, 0), n_turns)  # a cut may fall inside an observation
    joined = []
    for i, turn in enumerate(part["turns"]):
        joined += turn + (part["observations"][i] if i < n_obs else [])
    assert joined == ids[:cut]
