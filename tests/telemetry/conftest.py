"""Short real runs shared by the telemetry tests (built once per session; each takes seconds)."""

from __future__ import annotations

import pytest

import weir

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


@pytest.fixture(scope="session")
def sync_run(tmp_path_factory):
    """Sync loop with a KL-to-reference term and a rollout correction, so their metrics appear."""
    d = tmp_path_factory.mktemp("sync_run")
    return weir.run(
        SHORT,
        [f"run.dir={d}", "algo.kl.coef=0.01", "algo.correction.mode=token_tis"],
        reward=spread_reward,
    )


@pytest.fixture(scope="session")
def async_run(tmp_path_factory):
    """Async loop, masking stale prefixes, with KL shaped into the reward."""
    d = tmp_path_factory.mktemp("async_run")
    return weir.run(
        {**SHORT, "loop": {"mode": "async", "on_weight_update": "mask_stale"}},
        [f"run.dir={d}", "algo.kl.coef=0.01", "algo.kl.as_reward=true"],
        reward=spread_reward,
    )
