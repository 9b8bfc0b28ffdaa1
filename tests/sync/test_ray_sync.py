"""After a sync on Ray, every engine replica holds the trainer's weights and version, also when one
dies while the weights travel or before it joins the group they travel in."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import ray

from tests.toy import toy_groups
from weir.cluster import RayCluster
from weir.config import build_config
from weir.engine.router import Router
from weir.loop.ray_build import load_for_engine
from weir.sync.coordinator import WeightSync
from weir.sync.endpoints import SyncEngineWorker, SyncTrainerRank
from weir.train.batch import make_batch
from weir.train.distributed import RankSettings, TrainerGroup


@pytest.mark.slow
@pytest.mark.heavy  # CI: tests/cluster/test_matrix_on_ray.py's cells verify every sync on Ray
def test_every_transport_delivers_the_trainers_weights(ray_local, tiny_model_dir, tmp_path):
    cfg = build_config(
        {},
        [
            "rollout.batch_prompts=2",
            "rollout.n=4",
            "train.lr=1e-2",
            "cluster.type=ray",
            "cluster.trainer.ranks=2",
            "cluster.engines.replicas=2",
            "cluster.trainer.cpus_per_rank=0.5",
            "cluster.engines.cpus=0.5",
        ],
    )
    cluster = RayCluster(cfg.cluster).start()
    try:
        trainer = TrainerGroup(
            cluster, RankSettings.from_config(cfg), str(tiny_model_dir), rank_cls=SyncTrainerRank
        )
        worker = ray.remote(SyncEngineWorker)
        engines = [
            worker.options(**cluster.engine_options(i)).remote(
                cfg.engine, str(tiny_model_dir), i, load_for_engine, seed=cfg.run.seed
            )
            for i in range(2)
        ]
        router = Router(engines)
        batch = make_batch(toy_groups(), version=0)
        initial = ray.get(engines[0].weights_hash.remote())
        for version, transport in enumerate(("broadcast", "disk", "object_store", "broadcast"), 1):
            sync = WeightSync(trainer, router, transport, disk_dir=tmp_path / "w", bucket_mb=0.25)
            trainer.train(batch)
            stats = sync.push(version)
            assert stats["sync/mb"] > 0.1 and stats["time/sync"] > 0
            want = trainer.call("weights_hash")[0]
            got = ray.get([e.weights_hash.remote(None) for e in engines])
            versions = ray.get([e.version.remote() for e in engines])
            assert want != initial
            assert versions == [version, version] and router.version == version
            assert got == [want, want], transport

        # replica 1 killed while the buckets travel: the push aborts the group (replica 0 would
        # wait for buckets that cannot come until gloo's 600 s timeout) and goes again to
        # replica 0; Ray restarts replica 1, which takes the weights from its live peer
        sync = WeightSync(trainer, router, "broadcast", bucket_mb=1 / 64)
        router.restore = sync.restore
        sync.push(5)  # forms the group
        trainer.train(batch)
        start = time.perf_counter()
        sync.push(6)
        clean_s = time.perf_counter() - start
        for version, fraction in enumerate((0.5, 0.25, 0.1), 7):  # the kill must land half way
            trainer.train(batch)
            kill = threading.Timer(
                fraction * clean_s, ray.kill, (engines[1],), {"no_restart": False}
            )
            kill.start()
            stats = sync.push(version)
            kill.join()
            if sync.retries:
                break
            _generate(router)  # killed after its push: back (restored) before the next
            assert router.wait_healthy(120)
        assert sync.retries == 1, f"no kill landed during a push ({clean_s:.2f} s)"
        assert stats["cluster/sync_retries"] == 1 and stats["time/sync"] < 60
        want = trainer.call("weights_hash")[0]
        assert ray.get(engines[0].weights_hash.remote(None)) == want
        _generate(router)  # meets the restarted replica, which is restored in the background
        assert router.wait_healthy(120) and router.restarts >= 1
        assert ray.get([e.weights_hash.remote(None) for e in engines]) == [want, want]
        assert ray.get([e.version.remote() for e in engines]) == [version, version]

        # replica 1 dies for good as the next push forms a group (after it told its device, as
        # it is asked to join): its join fails, the forming group is aborted (rank 0 and replica 0
        # would wait for it in gloo's rendezvous until its 600 s timeout, and rank 0 would take
        # no other call meanwhile), and the push goes again, in a new group, to replica 0
        trainer.train(batch)
        sync._members = None  # as after a replica's restart: the next push forms a new group
        router.replicas[1] = _DiesAtJoin(engines[1])
        stats = sync.push(version + 1)
        assert sync.retries == 2, "the dead replica did not fail the group's formation"
        assert stats["time/sync"] < 60
        want = trainer.call("weights_hash")[0]
        assert ray.get(engines[0].weights_hash.remote(None)) == want
        assert ray.get(engines[0].version.remote()) == version + 1
        router.close()
        trainer.shutdown()
    finally:
        cluster.shutdown()


class _DiesAtJoin:
    """A replica's actor handle that kills the actor (for good) when asked to join a group."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def __getattr__(self, name: str):
        if name == "join":
            ray.kill(self.actor, no_restart=True)
        return getattr(self.actor, name)


def _generate(router) -> None:
    """A few requests over every replica (one that Ray restarted is restored before it serves)."""
    from weir.engine.base import SamplingParams

    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=4)

    async def go():
        return await asyncio.gather(*(router.generate([5, 6, 7, i], params) for i in range(4)))

    assert len(asyncio.run(go())) == 4
