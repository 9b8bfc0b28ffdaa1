"""Ray placement: bundles for trainer ranks and engines, colocated or not; clear errors."""

from __future__ import annotations

import os
import subprocess
import sys

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


START_OWN_RAY = """
import ray
from weir.cluster import RayCluster
from weir.config import build_config

cfg = build_config({"data": {"task": "arithmetic"}}, ["cluster.type=ray", "cluster.num_cpus=3"])
cluster = RayCluster(cfg.cluster).start()
print("own ray:", len(ray.nodes()), ray.cluster_resources()["CPU"])
cluster.shutdown()
"""


def test_without_an_address_a_run_starts_its_own_ray_whatever_else_this_machine_runs():
    """cluster.address unset: weir starts a Ray of its own with cluster.num_cpus, even where
    RAY_ADDRESS names another (there, or another run's Ray as the machine's latest, ray.init would
    join it and then refuse num_cpus)."""
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9"}  # nothing listens there
    out = subprocess.run(
        [sys.executable, "-c", START_OWN_RAY], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "own ray: 1 3.0" in out.stdout
