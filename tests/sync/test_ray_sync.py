"""After a sync on Ray, every engine replica holds the trainer's weights and version."""

from __future__ import annotations

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
        router.close()
        trainer.shutdown()
    finally:
        cluster.shutdown()
