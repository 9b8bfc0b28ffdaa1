"""The reward model in Ray reward actors (cluster.reward_workers): each actor loads its own copy
from the path and scores like the driver would."""

from __future__ import annotations

import asyncio

import pytest
from test_reward_models import build_rm, expected_logit

from weir.data.sample import Sample, Status
from weir.rollout.rewards import get_reward, score


@pytest.mark.slow
def test_reward_model_scores_in_ray_actors(ray_local, tmp_path):
    from weir.cluster.rewards import RewardPool

    model, tok = build_rm(tmp_path / "rm")
    cases = [("3+4", "7"), ("12+30", "42"), ("9+9", "seventeen")]
    pool = RewardPool(
        get_reward("reward_model", path=str(tmp_path / "rm"), batch_size=8, max_wait_ms=100),
        workers=1,
        num_cpus=0.1,
    )
    samples = [Sample(prompt_ids=[1], response_ids=[5], response_text=r) for _, r in cases]

    async def go():
        await asyncio.gather(
            *(
                score(pool.reward, s, {"prompt": p}, timeout_s=120)
                for s, (p, _) in zip(samples, cases, strict=True)
            )
        )

    try:
        asyncio.run(go())
    finally:
        pool.shutdown()
    for s, (p, r) in zip(samples, cases, strict=True):
        assert s.status == Status.COMPLETED, s.error
        assert s.reward == pytest.approx(expected_logit(model, tok, p, r), abs=1e-4)
    # nothing was loaded in the driver: the actor loaded its own copy
    from weir.rollout import reward_models

    assert not any(str(tmp_path) in k for k in reward_models._MODELS)
