"""The calculator-tool task: the tool, its data, and SFT rows laid out as the rollout lays out tokens."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import weir
from weir.config import build_config
from weir.config.schema import AgentConfig
from weir.engine.base import Completion, SamplingParams
from weir.loop.components import PromptEncoder
from weir.rollout.env import ToolEnv
from weir.rollout.multi_turn import agent_extras, run_episode
from weir.rollout.rewards import get_reward
from weir.rollout.single_turn import RolloutContext
from weir.tasks import get_task
from weir.tasks.calculator import calc, make_rows, sft_rows
from weir.tasks.tiny_model import build_tokenizer


class ScriptedEngine:
    """Plays the given turns in order (each followed by EOS), recording the prompts it gets."""

    def __init__(self, turns: list[str]) -> None:
        self.tok, self.turns, self.version, self.prompts = build_tokenizer(), turns, 0, []

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        text = self.turns[len(self.prompts) - 1]
        ids = [*self.tok(text, add_special_tokens=False)["input_ids"], self.tok.eos_token_id]
        return [Completion(ids, [-0.1] * len(ids), [0] * len(ids), "stop")]


QUICK = str(Path(__file__).parents[2] / "examples" / "calculator_quick.yaml")


def test_calc_is_exact_and_refuses_anything_but_arithmetic():
    assert calc("347*86") == "29842" and calc("(2+3)*-4") == "-20" and calc("7/2") == "3.5"
    assert calc(" 10 // 3 + 10 % 3 ") == "4"
    for bad in ("__import__('os')", "2**10", "x*2", "[1]*3", "'a'*3"):
        with pytest.raises(ValueError):
            calc(bad)
    with pytest.raises(ZeroDivisionError):
        calc("1/0")


def test_rows_are_correct_deterministic_and_splits_disjoint():
    train = make_rows("train", 300, 0, digits=[3, 2])
    assert train == make_rows("train", 300, 0, digits=[3, 2])
    test = make_rows("test", 100, 0, digits=[3, 2])
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for r in train + test:
        a, b = r["prompt"].split("*")
        assert len(a) == 3 and len(b) == 2 and r["answer"] == str(int(a) * int(b))
    assert len({r["prompt"] for r in train}) == 300
    small = {int(r["prompt"].split("*")[1]) for r in make_rows("train", 200, 0, digits=[3, 1])}
    assert small == set(range(2, 10))  # x0 and x1 need no calculator
    assert get_task("calculator").reward == "exact_match"


def test_sft_mix_has_the_requested_tool_fraction():
    rows = sft_rows(200, 1, tool_fraction=0.25, digits=[2, 1])
    first_turns = [r for r in rows if "prompt" in r]
    assert len(first_turns) == 200
    assert sum(r["uses_tool"] for r in first_turns) == 50
    assert len(rows) == 250  # each tool problem adds the answer row after the tool result
    direct = [r for r in first_turns if not r["uses_tool"]]
    assert all(r["response"] == r["answer"] for r in direct)


def test_sft_rows_match_the_tokens_the_rollout_produces():
    """SFT's second-turn prompt (call + tool result in `messages`) is exactly the id sequence the
    multi-turn rollout feeds the engine after the call, so SFT teaches the RL layout."""
    tok = build_tokenizer()
    cfg = build_config(
        {}, ["data.task=calculator", "rollout.function=weir.rollout.multi_turn:rollout"]
    )
    encode = PromptEncoder(cfg, tok)
    call_row, answer_row = [r for r in sft_rows(20, 0, tool_fraction=1.0)][:2]
    engine = ScriptedEngine([call_row["response"], answer_row["response"]])
    agent = AgentConfig(tools=["weir.tasks.calculator:calc"], tool_format="tag", show_tools=False)
    ctx = RolloutContext(
        engine=engine,
        tokenizer=tok,
        sampling=SamplingParams(max_new_tokens=32),
        reward_fn=get_reward("exact_match"),
        encode=encode,
        extras=agent_extras(cfg),
    )
    row = {"prompt": call_row["prompt"], "answer": call_row["answer"]}
    sample = asyncio.run(run_episode(ctx, row, ToolEnv(agent.tools, "tag"), agent))
    assert engine.prompts[0] == encode(call_row)
    assert engine.prompts[1] == encode(answer_row)
    assert sample.reward == 1.0 and sample.response_text == answer_row["response"]


@pytest.mark.slow
def test_rl_raises_tool_use_and_success_rate(tmp_path):
    sft_model = weir.sft(QUICK, [f"run.dir={tmp_path / 'sft'}"])
    result = weir.run(QUICK, [f"run.dir={tmp_path / 'rl'}", f"model.path={sft_model}"])
    hist = [h for h in result.history if "reward/mean" in h]
    rewards = [h["reward/mean"] for h in hist]
    calls = [h["agent/tool_calls_mean"] for h in hist]
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert end > start + 0.1, rewards
    assert sum(calls[-3:]) / 3 > sum(calls[:3]) / 3 + 0.1, calls
    before, after = result.evals[0]["eval/accuracy"], result.evals[-1]["eval/accuracy"]
    assert after > before + 0.1, (before, after)
    last = json.loads((result.dir / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("agent/turns_mean", "agent/tool_errors", "agent/malformed_calls"):
        assert key in last, key
