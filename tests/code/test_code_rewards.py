"""code_tests / code_io rewards: extraction, scoring, containment, metrics, and the python tool."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.data.sample import Sample, Status
from weir.rollout.code_rewards import build_program, extract_code
from weir.rollout.rewards import get_reward, score
from weir.rollout.tool_calls import ToolCall
from weir.rollout.tools import call_tool
from weir.sandbox import Limits, Sandbox
from weir.sandbox.tool import python

SB = Sandbox(Limits(wall_s=4, cpu_s=2))
ROW = {"tests": ["assert f(1) == 2", "assert f(0) == 0", "assert f(-3) == -6"]}


def _sample(text: str) -> Sample:
    return Sample(prompt_ids=[1], response_text=text)


def test_extraction_takes_the_last_python_block_else_the_whole_text():
    text = "plan\n```python\nx = 1\n```\nthen\n```\ny = 2\n```\n```bash\nls\n```"
    assert extract_code(text) == ("y = 2\n", "last_block")
    assert extract_code(text, "first_block") == ("x = 1\n", "first_block")
    assert extract_code("no fences here", "last_block") == (None, "no_block")
    assert extract_code("def f(x): return x") == ("def f(x): return x", "whole")
    assert extract_code("```py\nprint(1)") == ("print(1)", "last_block")  # unclosed last fence


@given(st.lists(st.text(alphabet="abcxyz=+ ()\n019", max_size=30), min_size=1, max_size=4))
@settings(max_examples=100, deadline=None)
def test_extraction_recovers_any_fenced_program(bodies):
    bodies = [b.replace("`", "") for b in bodies]
    text = "".join(f"words\n```python\n{b}\n```\n" for b in bodies)
    assert extract_code(text, "last_block")[0] == bodies[-1] + "\n"
    assert extract_code(text, "first_block")[0] == bodies[0] + "\n"


def test_completion_is_cut_at_stops_and_put_after_the_prefix():
    row = {"prefix": "def f(x):\n", "stop": ["\ndef "]}
    assert (
        build_program("    return x\ndef g(): pass", row, extracted_how="whole")
        == "def f(x):\n    return x"
    )
    assert build_program("def f(x):\n    return 1\n", row, extracted_how="last_block").startswith(
        "def f(x):\ndef f(x):"
    )


def test_code_tests_scores_the_fraction_or_all_of_the_tests_passed():
    frac = get_reward("code_tests", sandbox=SB)
    alln = get_reward("code_tests", mode="all", sandbox=SB)
    right, half = "```python\ndef f(x): return 2*x\n```", "def f(x): return x + 1"
    assert frac(_sample(right), ROW)["reward"] == 1.0
    r = frac(_sample(half), ROW)  # f(1)=2 passes, f(0)=1 and f(-3)=-2 fail
    assert (
        r["reward"] == pytest.approx(1 / 3)
        and r["tests_passed"] == 1
        and r["exec_status"] == "error"
    )
    assert alln(_sample(half), ROW)["reward"] == 0.0 and alln(_sample(right), ROW)["reward"] == 1.0
    assert frac(_sample("   "), ROW) == {
        "reward": 0.0,
        "tests_passed": 0,
        "tests": 3,
        "exec_status": "no_code",
        "exec_reason": "",
        "extracted": "empty",
    }
    loop = frac(_sample("def f(x):\n    while True: pass"), ROW)
    assert loop["reward"] == 0.0 and loop["exec_status"] in ("timeout", "cpu_time")


def test_code_io_compares_stdout_per_case():
    row = {
        "cases": [
            {"input": "1 2\n", "output": "3"},
            {"input": "5 5\n", "output": "10\n"},
            {"input": "0 7", "output": "8"},
        ]
    }
    program = "a, b = map(int, input().split())\nprint(a + b)"
    r = get_reward("code_io", sandbox=SB)(_sample(program), row)
    assert (
        r["reward"] == pytest.approx(2 / 3)
        and r["cases_passed"] == 2
        and r["exec_reason"] == "wrong output"
    )
    assert get_reward("code_io", mode="all", sandbox=SB)(_sample(program), row)["reward"] == 0.0
    exact = {"cases": [{"input": "", "output": "a  b\n"}]}
    assert (
        get_reward("code_io", compare="exact", sandbox=SB)(_sample("print('a  b')"), exact)[
            "reward"
        ]
        == 1.0
    )
    assert (
        get_reward("code_io", compare="exact", sandbox=SB)(_sample("print('a b')"), exact)["reward"]
        == 0.0
    )


def test_failures_are_contained_counted_and_exec_metrics_recorded():
    ok = _sample("def f(x): return 2*x")
    asyncio.run(score(get_reward("code_tests", sandbox=SB), ok, ROW, timeout_s=30))
    assert ok.reward == 1.0 and ok.status == Status.COMPLETED
    m = ok.metadata["metrics"]
    assert m["reward/exec_count"] == 1 and m["reward/exec_ok"] == 1 and m["reward/exec_seconds"] > 0
    # a row without tests is a data error: the sample fails with the reason, the call does not raise
    bad = _sample("def f(x): return x")
    asyncio.run(score(get_reward("code_tests", sandbox=SB), bad, {"prompt": "p"}, timeout_s=30))
    assert bad.status == Status.FAILED and "no tests under 'tests'" in bad.error
    # the sandbox itself failing (an interpreter that does not exist) fails the sample and is counted
    broken = Sandbox(level="rlimit", python="/bin/true")
    broken._iso = broken.isolation.__class__("rlimit", False, "/no/such/python", "/no")
    s = _sample("def f(x): return x")
    asyncio.run(score(get_reward("code_tests", sandbox=broken), s, ROW, timeout_s=30))
    assert s.status == Status.FAILED and "sandbox failure" in s.error
    assert s.metadata["metrics"]["reward/exec_sandbox_error"] == 1
    with pytest.raises(ValueError, match="mode"):
        get_reward("code_tests", mode="most")(ok, ROW)


def test_python_tool_runs_code_in_the_sandbox_and_shows_errors():
    assert (
        asyncio.run(call_tool(python, ToolCall("python", {"code": "print(6 * 7)"}))).content == "42"
    )
    r = asyncio.run(call_tool(python, ToolCall("python", {"input": "print(1/0)"})))  # tag format
    assert r.ok and "ZeroDivisionError: division by zero" in r.content and "<weir-" not in r.content
    big = asyncio.run(call_tool(python, ToolCall("python", {"code": "print('y' * 10000)"}))).content
    assert len(big) < 2100 and "characters cut" in big


def test_python_tool_in_a_multi_turn_tools_environment():
    from weir.rollout.env import ToolEnv

    env = ToolEnv(["weir.sandbox.tool:python"], "tag")
    step = asyncio.run(env.step("<python>print(2 ** 20)</python>"))
    assert step.observation == "1048576" and step.info["tool_calls"] == 1 and not step.done
    denied = asyncio.run(env.step("<python>import socket; socket.socket()</python>"))
    assert "denied: socket" in denied.observation
