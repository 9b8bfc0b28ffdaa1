"""Plugins passed as Python objects or dotted paths reach the loop; user data files drive a run."""

from __future__ import annotations

import json
import sys
import textwrap

import weir

SMALL = {
    "run": {"steps": 2, "eval_every": 0, "save_model": False},
    "model": {"path": "tiny:nano", "threads": 1},
    "rollout": {"n": 2, "batch_prompts": 3, "max_new_tokens": 3},
    "telemetry": {"console": False},
}


def test_reward_and_filter_as_python_objects(tmp_path):
    calls = []

    def reward(sample, row):
        calls.append(row["prompt"])
        return {"reward": float(len(sample.response_ids)), "length": len(sample.response_ids)}

    seen_groups = []

    def keep(group):
        seen_groups.append(len(group))
        return True

    cfg = {**SMALL, "data": {"task": "arithmetic", "eval_size": 4}}
    result = weir.run(cfg, [f"run.dir={tmp_path}"], reward=reward, filter=keep)
    # 2 steps x 3 prompts x 2 samples, plus 2 evaluations (before, after) x 4 prompts x 1 sample
    assert len(calls) == 2 * 3 * 2 + 2 * 4
    assert seen_groups == [2] * 6
    lengths = [h["response/length_mean"] for h in result.history[1:]]
    assert [h["reward/mean"] for h in result.history[1:]] == lengths  # our reward is the length


def test_user_jsonl_data_and_dotted_path_reward(tmp_path, monkeypatch):
    module = tmp_path / "my_rewards_mod.py"
    module.write_text(
        textwrap.dedent(
            """
            def score(sample, row, *, bonus=0.0):
                return float(sample.response_text.strip() == row["label"]) + bonus
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"{i}+1", "label": str(i + 1)}) + "\n" for i in range(5))
    )
    cfg = {
        **SMALL,
        "data": {
            "task": None,
            "source": str(data),
            "eval_source": str(data),
            "prompt_key": "question",
            "epochs": 1,
        },
        "reward": {"function": "my_rewards_mod:score", "kwargs": {"bonus": 0.5}},
    }
    result = weir.run(cfg, [f"run.dir={tmp_path / 'run'}", "run.steps=10"])
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 2  # 5 rows, 3 per step, one epoch: the run ends when the data is used up
    assert [e["step"] for e in result.evals] == [0, 2]  # the final policy is evaluated
    assert all(h["reward/mean"] >= 0.5 for h in steps)
    assert "my_rewards_mod" in sys.modules
