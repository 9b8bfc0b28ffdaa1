"""A simulated two-node Ray cluster: trainer ranks on one node, engines on the other."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"trainer_node": 2},
            "include_dashboard": False,
        },
    )
    engine_node = cluster.add_node(num_cpus=2, resources={"engine_node": 2})
    from weir.cluster.ray_cluster import driver_env

    ray.init(address=cluster.address, log_to_driver=False, runtime_env=driver_env())
    cluster.wait_for_nodes()
    yield cluster, engine_node
    ray.shutdown()
    cluster.shutdown()


PLACED = [
    "cluster.type=ray",
    "cluster.address=auto",
    "cluster.trainer.ranks=2",
    "cluster.trainer.cpus_per_rank=0.5",
    "cluster.trainer.resources={trainer_node: 1}",
    "cluster.engines.replicas=2",
    "cluster.engines.cpus=0.5",
    "cluster.engines.resources={engine_node: 1}",
]


@pytest.mark.slow
@pytest.mark.heavy  # CI: the one-node Ray runs place trainers and engines by the same bundles
def test_trainer_and_engines_on_different_nodes_complete_steps(two_nodes, tmp_path, monkeypatch):
    """One run: its placement is checked when its cluster is built (the bundles' nodes), then its
    steps complete with weights synced across the nodes."""
    import weir
    import weir.loop.ray_build as ray_build

    _, engine_node = two_nodes
    placed: list[tuple[set, set]] = []
    real_build = ray_build.build_ray

    def build_and_look(*args, **kwargs):
        from ray.util import placement_group_table

        parts = real_build(*args, **kwargs)
        nodes = [
            set(placement_group_table(pg)["bundles_to_node_id"].values())
            for pg in (parts.cluster.trainer_pg, parts.cluster.engine_pg)
        ]
        placed.append((nodes[0], nodes[1]))
        return parts

    monkeypatch.setattr(ray_build, "build_ray", build_and_look)
    small = {
        "run": {"steps": 2, "eval_every": 0, "save_model": False, "seed": 1},
        "model": {"path": "tiny:nano", "threads": 1},
        "data": {"task": "arithmetic", "eval_size": 2},
        "rollout": {"n": 2, "batch_prompts": 2, "max_new_tokens": 4},
        "telemetry": {"console": False},
    }
    result = weir.run(small, [f"run.dir={tmp_path / 'run'}", *PLACED])
    assert len(placed) == 1
    trainer_nodes, engine_nodes = placed[0]
    assert engine_nodes == {engine_node.node_id}
    assert len(trainer_nodes) == 1 and trainer_nodes.isdisjoint(engine_nodes)
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 2 and all(h["sync/mb"] > 0 for h in steps)
