"""Placement: where the trainer ranks and engine replicas run.

`local` is one process (the engine and the trainer in threads); `ray` places trainer ranks and
engine replicas as Ray actors in placement groups, colocated (an engine shares a trainer rank's
bundle) or disaggregated (engines in bundles of their own). The same config runs on both; only
the `cluster:` section changes.
"""

from __future__ import annotations

from weir.cluster.local import LocalCluster
from weir.cluster.ray_cluster import RayCluster, TrainerFailed

__all__ = ["LocalCluster", "RayCluster", "TrainerFailed", "make_cluster"]


def make_cluster(cfg) -> LocalCluster | RayCluster:
    """The cluster for a `ClusterConfig` (not started yet)."""
    return RayCluster(cfg) if cfg.type == "ray" else LocalCluster(cfg)
