"""The short real run the telemetry tests share: its config and a reward that gives every group
advantages to train on."""

from __future__ import annotations

# 3 steps of the tiny model on arithmetic: every phase runs, every sink writes
SHORT = {
    "run": {"steps": 3, "eval_every": 0, "save_model": True},
    "model": {"path": "tiny:nano", "threads": 1},
    "data": {"task": "arithmetic", "eval_size": 4},
    "rollout": {"n": 2, "batch_prompts": 3, "max_new_tokens": 3},
    "eval": {"n": 2, "temperature": 1.0},
    "telemetry": {"console": False, "dump_rollouts": True},
}


def spread_reward(sample, row) -> float:
    """1 for each prompt's first sample, else 0: every group has advantages to train on (an
    untrained model's all-zero rewards give none, and the step then skips the backward pass)."""
    return 1.0 if sample.index == 0 else 0.0
