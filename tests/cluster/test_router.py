"""Engine replicas behind the router: balanced, n samples on one replica, survive a dead replica."""

from __future__ import annotations

import asyncio

import pytest
import ray

from weir.cluster import TrainerFailed
from weir.config import build_config
from weir.engine.base import SamplingParams
from weir.loop.ray_build import build_ray


def _cfg(*extra: str):
    return build_config(
        {},
        [
            "rollout.batch_prompts=2",
            "rollout.n=4",
            "train.lr=1e-2",
            "cluster.type=ray",
            "cluster.engines.replicas=2",
            "cluster.trainer.cpus_per_rank=0.5",
            "cluster.engines.cpus=0.5",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def parts(ray_local, tiny_model_dir, tmp_path_factory):
    p = build_ray(_cfg(), tmp_path_factory.mktemp("run"), str(tiny_model_dir))
    yield p
    p.shutdown()


def _stat(parts, key: str) -> list[int]:
    """Engine stat `key` of every replica."""
    return [int(s[key]) for s in ray.get([r.stats.remote() for r in parts.router.replicas])]


def test_requests_spread_by_outstanding_and_n_samples_stay_together(parts):
    before = _stat(parts, "requests")
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=4)

    async def go():
        return await asyncio.gather(
            *[parts.router.generate([5, 6, 7, i], params) for i in range(8)]
        )

    out = asyncio.run(go())
    assert [len(c) for c in out] == [3] * 8  # each prompt's 3 samples came back together
    after = _stat(parts, "requests")
    assert [a - b for a, b in zip(after, before, strict=True)] == [4, 4]  # one request = one prompt


def test_drain_ends_every_replicas_responses_then_holds_new_ones(parts):
    """loop.on_weight_update=finish on Ray: `drain_sync` returns once every replica's responses in
    flight ended under the weights they started with; a request sent meanwhile waits, and after an
    update and `resume_sync` runs wholly under the new version."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40)
    old = parts.sync.version

    async def go():
        base = _stat(parts, "requests")
        tasks = [asyncio.create_task(parts.router.generate([5, 6, 7, i], params)) for i in range(4)]
        # every request admitted into its replica's running batch, none left waiting
        while sum(_stat(parts, "requests")) - sum(base) < 4 or any(
            _stat(parts, "waiting_requests")
        ):
            await asyncio.sleep(0.005)
        assert await asyncio.to_thread(parts.router.drain_sync, 60.0) is True
        done = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        ended = _stat(parts, "generated_tokens")
        held = asyncio.create_task(parts.router.generate([9, 9], params))
        await asyncio.sleep(0.3)
        assert not held.done() and _stat(parts, "generated_tokens") == ended  # nothing decoded
        await asyncio.to_thread(_push_one_version, parts)
        parts.router.resume_sync()
        return done, await asyncio.wait_for(held, 60)

    out, late = asyncio.run(go())
    comps = [c for cs in out for c in cs]
    assert len(comps) == 8 and all(c.finish_reason in ("stop", "length") for c in comps)
    assert all(set(c.versions) == {old} for c in comps)
    assert len(late) == 2 and all(set(c.versions) == {old + 1} for c in late)


def _push_one_version(parts):
    """Train one step and push it, so that a restarted replica has something to catch up on."""
    from tests.toy import toy_groups
    from weir.train.batch import make_batch

    parts.trainer.train(make_batch(toy_groups(), version=0))
    parts.sync.push(parts.sync.version + 1)


@pytest.mark.slow
def test_a_replica_killed_mid_generation_is_retried_restarted_and_resynced(parts):
    _push_one_version(parts)
    version = parts.sync.version
    victim = parts.router.replicas[0]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=48)

    async def go():
        tasks = [
            asyncio.create_task(parts.router.generate([5, 6, 7, i], params)) for i in range(10)
        ]
        while (await victim.stats.remote())["generated_tokens"] == 0:
            await asyncio.sleep(0.01)
        ray.kill(victim, no_restart=False)  # Ray restarts it (max_restarts)
        return await asyncio.gather(*tasks)

    out = asyncio.run(go())
    assert [len(c) for c in out] == [2] * 10  # the step's requests all completed
    assert all(len(s.token_ids) > 0 for c in out for s in c)
    assert parts.router.retries >= 1
    assert parts.router.wait_healthy(120)
    assert parts.router.restarts == 1 and all(parts.router.healthy)
    want = parts.trainer.call("weights_hash")[0]
    assert ray.get(victim.version.remote()) == version
    assert ray.get(victim.weights_hash.remote()) == want
    # the broadcast group is re-formed with the restarted replica in it
    _push_one_version(parts)
    want = parts.trainer.call("weights_hash")[0]
    assert ray.get([r.weights_hash.remote() for r in parts.router.replicas]) == [want, want]


def test_a_dead_trainer_rank_stops_with_a_clear_message(ray_local, tiny_model_dir):
    from weir.cluster import RayCluster
    from weir.train.distributed import RankSettings, TrainerGroup

    cfg = _cfg("cluster.trainer.ranks=2", "cluster.engines.replicas=1")
    cluster = RayCluster(cfg.cluster).start()
    try:
        group = TrainerGroup(cluster, RankSettings.from_config(cfg), str(tiny_model_dir))
        ray.kill(group.ranks[1])
        with pytest.raises(TrainerFailed, match="trainer rank 1 died"):
            group.call("full_state")  # rank 0 would wait for rank 1 in the collective forever
    finally:
        cluster.shutdown()


@ray.remote(num_cpus=0)
class _Rank:
    """A stand-in for a trainer rank in a collective: `fail` raises what gloo raises on a rank
    whose peer is gone, `die` ends the process, `ok` returns."""

    def run(self, what: str, delay_s: float = 0.0) -> int:
        import os
        import time

        time.sleep(delay_s)
        if what == "die":
            os._exit(1)
        if what == "fail":
            raise RuntimeError("gloo/transport/tcp/pair.cc: Connection reset by peer")
        return 1


@pytest.mark.parametrize("first", ["failed peer", "dead rank"])
def test_a_peers_collective_error_reports_the_rank_that_died(ray_local, first):
    """Rank 1 dies as rank 0 waits on it in a collective; rank 0's gloo error may reach the driver
    first (it did in a full run): the run stops on the dead rank all the same."""
    from weir.train.distributed import TrainerGroup

    group = object.__new__(TrainerGroup)
    group.ranks = [_Rank.remote(), _Rank.remote()]
    fail_after, die_after = (0.0, 0.5) if first == "failed peer" else (1.0, 0.0)
    refs = [
        group.ranks[0].run.remote("fail", fail_after),
        group.ranks[1].run.remote("die", die_after),
    ]
    with pytest.raises(TrainerFailed, match="trainer rank 1 died"):
        group.get(refs)


def test_a_ranks_own_error_is_raised_as_it_is_when_no_rank_died(ray_local):
    from weir.train.distributed import TrainerGroup

    group = object.__new__(TrainerGroup)
    group.ranks = [_Rank.remote(), _Rank.remote()]
    refs = [group.ranks[0].run.remote("fail"), group.ranks[1].run.remote("ok", 0.5)]
    with pytest.raises(ray.exceptions.RayTaskError, match="Connection reset by peer"):
        group.get(refs)
    group.shutdown()
