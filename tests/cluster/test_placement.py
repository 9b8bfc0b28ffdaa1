"""Ray placement: bundles for trainer ranks and engines, colocated or not; clear errors."""

from __future__ import annotations

import pytest
import ray

from weir.cluster import LocalCluster, RayCluster, make_cluster
from weir.config import build_config


def _cluster_cfg(*extra: str):
    return build_config({"data": {"task": "arithmetic"}}, ["cluster.type=ray", *extra]).cluster


@ray.remote
class Where:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def resources(self) -> dict:
        return {k: v for k, v in ray.get_runtime_context().get_assigned_resources().items()}


def test_local_is_the_default_and_one_process():
    cfg = build_config({"data": {"task": "arithmetic"}}, [])
    assert isinstance(make_cluster(cfg.cluster), LocalCluster)
    with pytest.raises(ValueError, match="cluster.type=ray"):
        build_config({"data": {"task": "arithmetic"}}, ["cluster.trainer.ranks=2"])
    with pytest.raises(ValueError, match="run.deterministic needs cluster.type=local"):
        build_config(
            {"data": {"task": "arithmetic"}}, ["cluster.type=ray", "run.deterministic=true"]
        )


def test_colocated_engines_share_the_trainer_bundles(ray_local):
    cfg = _cluster_cfg(
        "cluster.colocate=true",
        "cluster.trainer.ranks=2",
        "cluster.trainer.cpus_per_rank=0.5",
        "cluster.engines.replicas=3",
        "cluster.engines.cpus=0.25",
    )
    cluster = RayCluster(cfg).start()
    try:
        assert cluster.engine_pg is None
        # bundle 0 holds rank 0 and replicas 0 and 2; bundle 1 rank 1 and replica 1
        assert [b["CPU"] for b in cluster.trainer_pg.bundle_specs] == [1.0, 0.75]
        assert [
            cluster.engine_options(i)["scheduling_strategy"].placement_group_bundle_index
            for i in range(3)
        ] == [0, 1, 0]
        actors = [Where.options(**cluster.trainer_options(r)).remote() for r in range(2)]
        actors += [Where.options(**cluster.engine_options(i)).remote() for i in range(3)]
        got = ray.get([a.resources.remote() for a in actors])
        assert [g["CPU"] for g in got] == [0.5, 0.5, 0.25, 0.25, 0.25]
    finally:
        cluster.shutdown()


def test_unplaceable_bundles_name_the_section(ray_local):
    cfg = _cluster_cfg("cluster.trainer.ranks=2", "cluster.trainer.cpus_per_rank=64")
    with pytest.raises(ValueError, match="cluster.trainer: Ray cannot place"):
        RayCluster(cfg).start(timeout_s=2)
