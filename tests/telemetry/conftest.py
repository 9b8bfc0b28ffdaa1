"""Short real runs shared by the telemetry tests (built once per session; each takes seconds)."""

from __future__ import annotations

import pytest
from short_runs import SHORT, spread_reward

import weir


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
