"""The Ray cluster: placement groups for trainer ranks and engine replicas.

Trainer ranks get one bundle each in one placement group (`PACK`: ranks on as few nodes as
possible, which keeps FSDP2 traffic local). Engine replicas get a placement group of their own
(disaggregated) or a share of a trainer bundle (`colocate: true`, replica i in bundle
i mod ranks; the bundle's GPUs are split between the rank and its engines). Custom resources in
`cluster.trainer.resources` / `cluster.engines.resources` go into the bundles, which pins them
to nodes that offer those resources.
"""

from __future__ import annotations

import os
import sys
from typing import Any


class TrainerFailed(RuntimeError):
    """A trainer rank died: the run stops (resume it from its last checkpoint)."""


def _bundle(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, float]:
    b = {"CPU": float(cpus), **{k: float(v) for k, v in resources.items()}}
    if gpus:
        b["GPU"] = float(gpus)
    return {k: v for k, v in b.items() if v > 0}


def driver_env() -> dict[str, Any]:
    """A runtime_env giving Ray workers this process's import path, so that plugins (rewards,
    rollouts) importable here are importable in tasks and actors of a local Ray too."""
    path = os.pathsep.join(p for p in sys.path if p)
    return {"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}}


class RayCluster:
    """Joins (or starts) Ray and reserves the bundles; hands out actor options for each role.

    `engine_groups`: how many groups of `cluster.engines.replicas` engines to place (one per
    policy with multi_agent.policies=separate); engine index i is replica i % replicas of group
    i // replicas."""

    kind = "ray"

    def __init__(self, cfg, engine_groups: int = 1) -> None:
        self.cfg = cfg
        self.engine_groups = engine_groups
        self.trainer_pg: Any = None
        self.engine_pg: Any = None
        self._started_ray = False

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> RayCluster:
        import ray
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"address": self.cfg.address, "log_to_driver": True}
            if self.cfg.address is None:  # a Ray of our own: its workers import what we import
                # "local", not None: None would join whatever Ray this machine last started (another
                # run's, a `ray start`), or RAY_ADDRESS, and then refuse num_cpus
                kwargs["address"] = "local"
                kwargs["num_cpus"] = self.cfg.num_cpus
                kwargs["include_dashboard"] = False
                kwargs["runtime_env"] = driver_env()
            ray.init(**kwargs)
            self._started_ray = True
        t, e = self.cfg.trainer, self.cfg.engines
        engines = e.replicas * self.engine_groups
        if self.cfg.colocate:
            per = self._engines_per_bundle()
            bundles = [
                _bundle(
                    t.cpus_per_rank + per[r] * e.cpus,
                    max(t.gpus_per_rank, e.gpus),
                    {**e.resources, **t.resources},
                )
                for r in range(t.ranks)
            ]
            self.trainer_pg = placement_group(bundles, strategy="PACK")
        else:
            self.trainer_pg = placement_group(
                [_bundle(t.cpus_per_rank, t.gpus_per_rank, t.resources)] * t.ranks,
                strategy="PACK",
            )
            self.engine_pg = placement_group(
                [_bundle(e.cpus, e.gpus, e.resources)] * engines,
                strategy="PACK",
            )
        for name, pg in (("cluster.trainer", self.trainer_pg), ("cluster.engines", self.engine_pg)):
            if pg is None:
                continue
            try:
                ray.get(pg.ready(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                have = ray.cluster_resources()
                self.shutdown()
                raise ValueError(
                    f"{name}: Ray cannot place bundles {pg.bundle_specs} within {timeout_s:.0f} s; "
                    f"the cluster offers {have}; lower the {name} resources or add nodes"
                ) from None
        return self

    def shutdown(self) -> None:
        """Release the placement groups (their actors end with them); stop Ray if we started it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        for pg in (self.engine_pg, self.trainer_pg):
            if pg is not None:
                remove_placement_group(pg)
        self.engine_pg = self.trainer_pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    # -- placement ----------------------------------------------------------------------------------

    def _engines_per_bundle(self) -> list[int]:
        ranks = self.cfg.trainer.ranks
        engines = self.cfg.engines.replicas * self.engine_groups
        return [len(range(r, engines, ranks)) for r in range(ranks)]

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """`.options(...)` of trainer rank `rank`'s actor."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        t = self.cfg.trainer
        gpus = t.gpus_per_rank
        if self.cfg.colocate and gpus:
            gpus = gpus / (1 + self._engines_per_bundle()[rank])
        return {
            "num_cpus": t.cpus_per_rank,
            "num_gpus": gpus,
            "max_restarts": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.trainer_pg, placement_group_bundle_index=rank
            ),
        }

    def engine_options(self, index: int) -> dict[str, Any]:
        """`.options(...)` of engine replica `index`'s actor (restarted by Ray when it dies)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        e = self.cfg.engines
        if self.cfg.colocate:
            ranks = self.cfg.trainer.ranks
            bundle, pg = index % ranks, self.trainer_pg
            share = max(self.cfg.trainer.gpus_per_rank, e.gpus)
            gpus = share / (1 + self._engines_per_bundle()[bundle]) if share else 0.0
        else:
            bundle, pg, gpus = index, self.engine_pg, e.gpus
        return {
            "num_cpus": e.cpus,
            "num_gpus": gpus,
            "max_restarts": e.max_restarts,
            "max_task_retries": 0,  # the router retries a lost request on another replica
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=bundle
            ),
        }

    def describe(self) -> dict[str, object]:
        return {
            "type": "ray",
            "trainer_ranks": self.cfg.trainer.ranks,
            "engine_replicas": self.cfg.engines.replicas * self.engine_groups,
            "colocate": self.cfg.colocate,
        }
