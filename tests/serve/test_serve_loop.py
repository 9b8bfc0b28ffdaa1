"""An OpenAI-client agent plugs into weir's training loop as `rollout.function` (a dotted path)."""

from __future__ import annotations

import statistics
import sys
import textwrap

import weir

AGENT_MODULE = """
import openai
from weir.serve import agent_rollout

REWARDS = []

def agent(base_url, api_key, row):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "final answer?"},
    ]
    final = client.chat.completions.create(model="policy", messages=messages)
    reward = float(len(final.choices[0].message.content) % 2)
    REWARDS.append(reward)
    return reward

rollout = agent_rollout(agent)
"""


def test_agent_rollout_trains_through_the_sync_loop(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "my_openai_agent", raising=False)
    (tmp_path / "my_openai_agent.py").write_text(textwrap.dedent(AGENT_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = {
        "run": {"steps": 2, "eval_every": 0, "save_model": False, "dir": str(tmp_path / "run")},
        "model": {"path": "tiny:nano", "threads": 1},
        "data": {"task": "arithmetic", "eval_size": 2},
        "rollout": {
            "function": "my_openai_agent:rollout",
            "n": 2,
            "batch_prompts": 2,
            "max_new_tokens": 3,
        },
        "telemetry": {"console": False},
    }
    result = weir.run(cfg)
    import my_openai_agent

    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 2
    rewards = my_openai_agent.REWARDS
    # evaluation before (2 prompts x eval.n=1), 2 steps x 2 prompts x 2 sessions, evaluation after
    assert len(rewards) == 2 + 2 * 2 * 2 + 2
    for k, h in enumerate(steps):
        assert h["reward/mean"] == statistics.mean(rewards[2 + 4 * k : 6 + 4 * k])
        assert h.get("rollout/failed", 0) == 0


def test_agent_rollout_runs_in_the_async_loop(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "my_openai_agent", raising=False)
    (tmp_path / "my_openai_agent.py").write_text(textwrap.dedent(AGENT_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = {
        "run": {"steps": 2, "eval_every": 0, "save_model": False, "dir": str(tmp_path / "run")},
        "model": {"path": "tiny:nano", "threads": 1},
        "data": {"task": "arithmetic", "eval_size": 2},
        "rollout": {"function": "my_openai_agent:rollout", "n": 2, "batch_prompts": 2},
        "loop": {"mode": "async"},
        "telemetry": {"console": False},
    }
    result = weir.run(cfg)
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 2
    assert all(h.get("rollout/failed", 0) == 0 for h in steps)
    assert all(h["reward/mean"] in (0.0, 0.25, 0.5, 0.75, 1.0) for h in steps)
