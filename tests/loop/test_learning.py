"""End to end on CPU: SFT warm start, then GRPO raises reward on an easy task within CI's time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import weir

EASY = str(Path(__file__).parents[2] / "examples" / "arithmetic_quick.yaml")


@pytest.mark.slow
def test_grpo_raises_reward_after_sft(tmp_path):
    sft_model = weir.sft(EASY, [f"run.dir={tmp_path / 'sft'}"])
    result = weir.run(
        EASY, [f"run.dir={tmp_path / 'rl'}", f"model.path={sft_model}", "run.steps=20"]
    )
    rewards = [h["reward/mean"] for h in result.history if "reward/mean" in h]
    assert len(rewards) == 20
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert end > start + 0.1, rewards
    before, after = result.evals[0]["eval/accuracy"], result.evals[-1]["eval/accuracy"]
    assert after > before + 0.2, (before, after)
    lines = [json.loads(line) for line in (result.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(21))
    for key in (
        "reward/mean",
        "train/entropy",
        "policy/clipfrac_high",
        "mismatch/abs_logp_diff",
        "staleness/mean",
        "time/generate",
    ):
        assert key in lines[-1], key
    assert lines[-1]["mismatch/abs_logp_diff"] < 1e-4  # the built-in engine is on-policy
    assert (result.model_dir / "model.safetensors").exists()
