"""The Ray side of `build`: trainer ranks, engine replicas behind a router, and the weight sync.

Chosen by `cluster.type=ray`; everything else in the config means what it means in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weir.cluster import RayCluster
from weir.cluster.rewards import RewardPool
from weir.config import Config
from weir.config.devices import resolve_dtype
from weir.engine.router import Router
from weir.sync.coordinator import WeightSync
from weir.sync.endpoints import SyncEngineWorker, SyncTrainerRank
from weir.train.distributed import RankSettings, TrainerGroup


@dataclass
class RayParts:
    cluster: RayCluster
    trainer: TrainerGroup
    router: Router
    sync: WeightSync
    reward_pool: RewardPool | None = None

    def rewards(self, fn: Callable) -> Callable:
        """`fn` scored in `cluster.reward_workers` Ray actors instead of the driver."""
        self.reward_pool = RewardPool(fn, workers=self.trainer.cluster.reward_workers)
        return self.reward_pool.reward

    def shutdown(self) -> None:
        if self.reward_pool is not None:
            self.reward_pool.shutdown()
        self.router.close()
        self.trainer.shutdown()
        self.cluster.shutdown()


def load_for_engine(model_path: str, dtype: str) -> tuple[Any, Any, list[int]]:
    """How an engine replica loads its model: the trainer's loader, so both run the same HF class."""
    from weir.train.model import eos_token_ids, load_model

    model, tokenizer = load_model(model_path, dtype)
    return model, tokenizer, eos_token_ids(model, tokenizer)


def build_ray(cfg: Config, run_dir: Path, model_path: str) -> RayParts:
    """Start (or join) Ray, place trainer ranks and engines, connect the weight sync."""
    import ray

    c = cfg.cluster
    cluster = RayCluster(c).start()
    try:
        trainer = TrainerGroup(
            cluster, RankSettings.from_config(cfg), model_path, rank_cls=SyncTrainerRank
        )
        remote = ray.remote(SyncEngineWorker)
        replicas = [
            remote.options(**cluster.engine_options(i)).remote(
                cfg.engine,
                model_path,
                i,
                load_for_engine,
                seed=cfg.run.seed,
                on_gpu=c.engines.gpus > 0,
                cudnn_attention=cfg.model.cudnn_attention,
                deterministic=cfg.run.deterministic,
                record_routing=cfg.algo.routing_replay,
            )
            for i in range(c.engines.replicas)
        ]
        ray.get([r.ping.remote() for r in replicas])
        router = Router(replicas, seed=cfg.run.seed)
        router.sleep_mode = c.colocate and cfg.engine.sleep_while_training
        router.sleep_offload_weights = cfg.engine.sleep_offload_weights
        transport = "broadcast" if c.weight_sync == "auto" else c.weight_sync
        engine_device = torch.device("cuda" if c.engines.gpus > 0 else "cpu")
        sync = WeightSync(
            trainer,
            router,
            transport,
            disk_dir=c.sync_dir or run_dir / "weights",
            bucket_mb=c.bucket_mb,
            backend="nccl" if c.trainer.gpus_per_rank > 0 and c.engines.gpus > 0 else "gloo",
            dtype=str(resolve_dtype(cfg.engine.dtype, engine_device)).removeprefix("torch."),
            host_handles=c.colocate,
        )
        router.restore = sync.restore
    except BaseException:
        cluster.shutdown()
        raise
    return RayParts(cluster, trainer, router, sync)


def describe(parts: Any) -> dict[str, float]:
    """Cluster counters for the step metrics: engine retries and restarts."""
    return {
        "cluster/engine_retries": float(parts.router.retries),
        "cluster/engine_restarts": float(parts.router.restarts),
    }
