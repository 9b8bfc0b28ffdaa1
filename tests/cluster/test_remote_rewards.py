"""Rewards scored in Ray actors: off the driver, failures contained, timeouts honoured."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from weir.cluster.rewards import RewardPool
from weir.data.sample import Sample, Status
from weir.rollout.rewards import score


def where(sample, row):
    """Scores, and says where: the worker's pid, whether torch was loaded before this reward
    imported it (neither the worker nor a text sample needs it), and torch's threads there."""
    time.sleep(0.05)
    had_torch = "torch" in sys.modules
    import torch

    return {
        "reward": float(row["answer"] == "4"),
        "pid": float(os.getpid()),
        "had_torch": float(had_torch),
        "threads": float(torch.get_num_threads()),
    }


def slow(sample, row):
    time.sleep(60)
    return 1.0


def broken(sample, row):
    raise ValueError("no answer tag")


async def async_reward(sample, row):
    await asyncio.sleep(0)
    return 0.5


def _score(fn, n: int = 1, timeout_s=None, workers: int = 1, took: list | None = None):
    """`n` samples scored by a pool of `workers`; `took` receives the seconds the scoring took
    (the pool's start-up, which precedes it, not counted)."""
    pool = RewardPool(fn, workers=workers, num_cpus=0.1)
    samples = [Sample(prompt_ids=[1], response_ids=[2, 3]) for _ in range(n)]

    async def go():
        await asyncio.gather(
            *(score(pool.reward, s, {"answer": "4"}, timeout_s=timeout_s) for s in samples)
        )

    try:
        start = time.perf_counter()
        asyncio.run(go())
        if took is not None:
            took.append(time.perf_counter() - start)
    finally:
        pool.shutdown()
    return samples


def test_rewards_run_in_ray_actors_and_fail_contained(ray_local):
    got = _score(where, n=6, workers=2)
    assert all(s.reward == 1.0 for s in got)
    pids = {s.reward_info["pid"] for s in got}
    assert len(pids) == 2 and os.getpid() not in pids  # both workers used, neither is the driver
    assert min(s.reward_info["had_torch"] for s in got) == 0.0
    assert all(s.reward_info["threads"] == 1.0 for s in got)
    assert _score(async_reward)[0].reward == 0.5
    bad = _score(broken)[0]
    assert (
        bad.status == Status.FAILED and "ValueError" in bad.error and "no answer tag" in bad.error
    )
    assert "broken" in bad.error  # the message names the user's function
    took = []
    late = _score(slow, timeout_s=1.0, took=took)[0]
    assert late.status == Status.FAILED and "timeout" in late.error
    assert took[0] < 15  # the 1 s timeout, not the function's 60 s


class SlowToStart:
    """A reward whose worker takes `delay` seconds to build it (as importing a heavy module does
    in a fresh process on a loaded machine); `fails`: it cannot be built there at all."""

    def __init__(self, delay: float, fails: bool = False) -> None:
        self.delay, self.fails = delay, fails

    def __setstate__(self, state: dict) -> None:
        if state["fails"]:
            raise ImportError("No module named 'my_rewards'")
        time.sleep(state["delay"])
        self.__dict__.update(state)

    def __call__(self, sample, row) -> float:
        return 1.0


def test_the_reward_timeout_bounds_the_function_not_a_workers_start_up(ray_local):
    start, took = time.perf_counter(), []
    got = _score(SlowToStart(delay=6.0), n=2, timeout_s=2.0, workers=2, took=took)
    assert time.perf_counter() - start - took[0] >= 6.0  # the pool waited for its workers
    assert all(s.status != Status.FAILED and s.reward == 1.0 for s in got), [s.error for s in got]


def test_a_reward_worker_that_cannot_start_ends_the_run_saying_why(ray_local):
    with pytest.raises(
        ValueError, match="reward workers for SlowToStart could not start.*my_rewards"
    ):
        RewardPool(SlowToStart(0.0, fails=True), workers=1, num_cpus=0.1)


def test_a_ray_run_whose_reward_workers_cannot_start_says_why_and_releases_the_cluster(
    ray_local, tmp_path
):
    """The reward workers start beside the trainer ranks and engines (weir.loop.ray_build); when
    they cannot, the run ends with the reason, and no actor or placement group of it is left to
    hold the cluster's resources."""
    import weir

    config = {
        "run": {"steps": 1, "eval_every": 0, "dir": str(tmp_path)},
        "model": {"path": "tiny:nano", "threads": 1},
        "data": {"task": "arithmetic", "eval_size": 2},
        "rollout": {"n": 2, "batch_prompts": 2, "max_new_tokens": 2},
        "telemetry": {"console": False},
    }
    cluster = [
        "cluster.type=ray",
        "cluster.trainer.ranks=1",
        "cluster.trainer.cpus_per_rank=0.5",
        "cluster.engines.cpus=0.5",
        "cluster.reward_workers=1",
    ]
    with pytest.raises(ValueError, match="reward workers for SlowToStart could not start"):
        weir.run(config, cluster, reward=SlowToStart(0.0, fails=True))
    from ray._private.state import actors  # the GCS's table (the state API needs a dashboard)

    groups = ray_local.util.placement_group_table().values()
    assert all(g["state"] == "REMOVED" for g in groups), list(groups)
    left = [
        a["ActorClassName"]
        for a in actors().values()
        if a["State"] != "DEAD"
        and a["ActorClassName"] in ("RewardWorker", "SyncTrainerRank", "SyncEngineWorker")
    ]
    assert not left, left
