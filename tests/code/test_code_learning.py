"""End to end on CPU: the code task learns from hidden tests run in the sandbox (CI-sized)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import weir

QUICK = str(Path(__file__).parents[2] / "examples" / "code_quick.yaml")


@pytest.mark.slow
def test_grpo_on_sandboxed_tests_teaches_the_parentheses(tmp_path):
    sft_model = weir.sft(QUICK, [f"run.dir={tmp_path / 'sft'}"])
    result = weir.run(QUICK, [f"run.dir={tmp_path / 'rl'}", f"model.path={sft_model}"])
    rewards = [h["reward/mean"] for h in result.history if "reward/mean" in h]
    assert len(rewards) == 10
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards
    before, after = result.evals[0]["eval/accuracy"], result.evals[-1]["eval/accuracy"]
    assert after > before + 0.15, (before, after)
    last = json.loads((result.dir / "metrics.jsonl").read_text().splitlines()[-1])
    # every sample's program ran in the sandbox, and its cost is in the metrics
    assert last["reward/exec_count"] == 64 and last["reward/exec_seconds"] > 0
    assert last["rollout/failed"] == 0
    trace = json.loads((result.dir / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert any(e.get("name") == "sandbox.exec" for e in events)
