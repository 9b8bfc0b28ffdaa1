"""End to end on CPU: SFT warm start, then GRPO raises reward on an easy task within CI's time."""

from __future__ import annotations

import json

import pytest

import weir

EASY = {
    "run": {"seed": 0, "eval_every": 0},
    "model": {"path": "tiny:tiny", "threads": 1},
    "data": {
        "task": "arithmetic",
        "task_options": {"digits": 1},
        "eval_size": 100,
        "train_size": 2000,
    },
    "sft": {
        "rows": 3000,
        "task_options": {"corrupt": 0.7},
        "batch_size": 64,
        "lr": 3e-3,
        "epochs": 4,
    },
    "rollout": {"n": 8, "batch_prompts": 32, "temperature": 1.0, "max_new_tokens": 4},
    "algo": {"advantage": "grpo", "policy_loss": "ppo", "old_logprobs": "engine"},
    "train": {"lr": 5e-5, "warmup_steps": 2},
    "eval": {"temperature": 0.0},
}


@pytest.mark.slow
def test_grpo_raises_reward_after_sft(tmp_path):
    cfg = weir.build_config(EASY, [f"run.dir={tmp_path / 'sft'}"])
    sft_model = weir.sft(cfg)
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
