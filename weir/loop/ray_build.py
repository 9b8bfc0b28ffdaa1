"""The Ray side of `build`: trainer ranks, engine replicas behind a router, and the weight sync.

Chosen by `cluster.type=ray`; everything else in the config means what it means in one process.
The features live in the pieces that own them: LoRA, the critic and one policy per role in the
trainer ranks (weir.train.rank_build); engines of any type placed on the engines' bundles, one
group of `cluster.engines.replicas` per policy; a weight sync per policy from the ranks' shards to
its engines (weir.sync).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weir.cluster import RayCluster
from weir.cluster.rewards import RewardPool
from weir.config import Config
from weir.config.devices import resolve_dtype
from weir.engine.remote import start_engine_servers
from weir.engine.role_router import RoleRouter
from weir.engine.router import Router
from weir.engine.server_engine import ServerEngine
from weir.engine.server_host import ray_placement
from weir.sync.coordinator import WeightSync
from weir.sync.endpoints import SyncEngineWorker, SyncTrainerRank
from weir.sync.server_sync import ServerSync
from weir.train.distributed import RankSettings, TrainerGroup


@dataclass
class RayParts:
    cluster: RayCluster
    trainer: TrainerGroup
    router: Any  # one policy: a Router (torch) or ServerEngine (vLLM / SGLang); else a RoleRouter
    sync: Any  # WeightSync / ServerSync, or RoleSyncs over one per policy
    reward_pool: RewardPool | None = None  # cluster.reward_workers scoring the run's reward
    roles: tuple[str, ...] = ()  # multi_agent.policies=separate: the policies, by role

    def shutdown(self) -> None:
        if self.reward_pool is not None:
            self.reward_pool.shutdown()
        self.router.close()
        self.trainer.shutdown()
        self.cluster.shutdown()


class RoleSyncs:
    """One weight sync per policy (multi_agent.policies=separate) as one: a push delivers every
    role's weights to its own engines under the same version."""

    def __init__(self, syncs: dict[str, Any]) -> None:
        self.syncs = dict(syncs)

    def push(self, version: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for sync in self.syncs.values():
            for k, v in sync.push(version).items():
                summed = k.startswith(("time/", "sync/mb", "sync/gather_s", "sync/deliver_s"))
                out[k] = out.get(k, 0.0) + v if summed and k != "sync/mb_per_s" else v
        if out.get("time/sync"):
            out["sync/mb_per_s"] = out.get("sync/mb", 0.0) / out["time/sync"]
        return out


def ray_roles(cfg: Config, run_dir: Path) -> dict[str, str]:
    """multi_agent.policies=separate on Ray: each role's model directory (built here for a
    `tiny:` model), for the ranks to load."""
    from weir.loop.role_policies import role_model_path

    return {r.name: role_model_path(cfg, run_dir, r) for r in cfg.multi_agent.roles}


def critic_model_path(cfg: Config, run_dir: Path) -> str | None:
    """`critic.model_path` resolved (a `tiny:` model built next to the run), or None."""
    from weir.train.model import resolve_model_path

    c = cfg.critic
    if cfg.algo.advantage != "gae" or c.model_path is None or c.shared_backbone:
        return None
    return resolve_model_path(
        c.model_path, run_dir.parent / ".models", arch=cfg.model.arch, seed=cfg.model.init_seed
    )


def load_for_engine(model_path: str, dtype: str) -> tuple[Any, Any, list[int]]:
    """How an engine replica loads its model: the trainer's loader, so both run the same HF class."""
    from weir.train.model import eos_token_ids, load_model

    model, tokenizer = load_model(model_path, dtype)
    return model, tokenizer, eos_token_ids(model, tokenizer)


def build_ray(
    cfg: Config,
    run_dir: Path,
    model_path: str,
    eos_token_ids: list[int] | None = None,
    *,
    roles: dict[str, str] | None = None,
    critic_path: str | None = None,
    reward: Callable | None = None,
) -> RayParts:
    """Start (or join) Ray, place trainer ranks and engines, connect the weight sync. `roles`:
    multi_agent.policies=separate, each role's model directory; `critic_path`: critic.model_path
    (both resolved by the driver); `reward`: the run's reward function, scored in
    `cluster.reward_workers` Ray actors (none: the caller scores it).

    The trainer ranks, the engines and the reward workers start at once: each is a process that
    imports torch and loads its model or module, and none needs another until the weight sync is
    connected, so the run starts in the time of the slowest group, not of all three in turn
    (engines that size their memory from what the trainer leaves start after it:
    `starts_side_by_side`)."""
    c = cfg.cluster
    groups = dict(roles) if roles else {"": model_path}
    cluster = RayCluster(c, engine_groups=len(groups)).start()
    pool = None
    try:
        if reward is not None and c.reward_workers:
            pool = RewardPool(reward, workers=c.reward_workers, wait=False)
        settings = dataclasses.replace(
            RankSettings.from_config(cfg),
            roles=tuple(roles.items()) if roles else (),
            critic_path=critic_path,
        )
        engine_groups = [
            EngineGroup(cfg, cluster, run_dir, role, path, k, len(groups))
            for k, (role, path) in enumerate(groups.items())
        ]
        start = _start_together if starts_side_by_side(cfg) else _start_in_turn
        trainer, engines = start(
            lambda: TrainerGroup(cluster, settings, model_path, rank_cls=SyncTrainerRank),
            lambda: _start_engines(engine_groups, eos_token_ids or []),
        )
        try:
            syncs = {g.role: g.connect(trainer, engines[g.role]) for g in engine_groups}
            if pool is not None:
                pool.wait_started()
        except BaseException:
            for e in engines.values():
                e.close()
            trainer.shutdown()
            raise
    except BaseException:
        if pool is not None:
            pool.shutdown()
        cluster.shutdown()
        raise
    if not roles:
        return RayParts(cluster, trainer, engines[""], syncs[""], reward_pool=pool)
    router = RoleRouter(engines, sleep_while_training=False)
    return RayParts(
        cluster, trainer, router, RoleSyncs(syncs), reward_pool=pool, roles=tuple(roles)
    )


def starts_side_by_side(cfg: Config) -> bool:
    """Whether the engines start while the trainer ranks do. Not where an engine sizes its memory
    from what is free when it starts and shares that memory with the trainer, since the trainer
    would be filling it meanwhile: colocated on the trainer's GPUs (vLLM and SGLang check and
    claim their share of the GPU as they start; the built-in engine reads `mem_get_info`), or
    on a CPU with `engine.kv_budget_fraction` (a fraction of the node's free RAM)."""
    if cfg.cluster.colocate:
        return False
    return not (cfg.cluster.engines.gpus == 0 and cfg.engine.kv_budget_fraction is not None)


def _start_in_turn(
    start_trainer: Callable[[], TrainerGroup], start_engines: Callable[[], dict[str, Any]]
) -> tuple[TrainerGroup, dict[str, Any]]:
    """The trainer ranks, then the engines (closing the trainer where they fail)."""
    trainer = start_trainer()
    try:
        return trainer, start_engines()
    except BaseException:
        trainer.shutdown()
        raise


def _start_together(
    start_trainer: Callable[[], TrainerGroup], start_engines: Callable[[], dict[str, Any]]
) -> tuple[TrainerGroup, dict[str, Any]]:
    """Both started side by side (the trainer's in a thread: both mostly wait on Ray). Where
    one fails, what the other started is closed once it has, and the failure raised (the
    engines' where both fail)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weir-trainer-start") as ex:
        trainer_future = ex.submit(start_trainer)
        try:
            engines = start_engines()
        except BaseException:
            with contextlib.suppress(BaseException):
                trainer_future.result().shutdown()
            raise
        try:
            trainer = trainer_future.result()
        except BaseException:
            for e in engines.values():
                e.close()
            raise
    return trainer, engines


def _start_engines(groups: list[EngineGroup], eos_token_ids: list[int]) -> dict[str, Any]:
    """Each group's engines, by role; where one group fails, the ones before it are closed."""
    engines: dict[str, Any] = {}
    try:
        for group in groups:
            engines[group.role] = group.start(eos_token_ids)
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    return engines


def engine_dtype(cfg: Config) -> str:
    """The engines' weight dtype on their device (`engine.dtype`, auto: bf16 on GPUs)."""
    device = torch.device("cuda" if cfg.cluster.engines.gpus > 0 else "cpu")
    return str(resolve_dtype(cfg.engine.dtype, device)).removeprefix("torch.")


def sync_backend(cfg: Config) -> str:
    """NCCL when trainer ranks and engines both have GPUs, else gloo."""
    c = cfg.cluster
    return "nccl" if c.trainer.gpus_per_rank > 0 and c.engines.gpus > 0 else "gloo"


@dataclass
class EngineGroup:
    """The engines of one policy: `cluster.engines.replicas` replicas (group k's take engine
    bundles k * replicas ...), of `engine.type`, and the weight sync from the ranks into them."""

    cfg: Config
    cluster: RayCluster
    run_dir: Path
    role: str
    model_path: str
    index: int = 0
    count: int = 1

    @property
    def first_bundle(self) -> int:
        return self.index * self.cfg.cluster.engines.replicas

    @property
    def work_dir(self) -> Path:
        return self.run_dir / "engine" / self.role if self.role else self.run_dir / "engine"

    def start(self, eos_token_ids: list[int]) -> Any:
        """The group's engines, started: a `Router` over weir's engine replicas, or a
        `ServerEngine` over vLLM / SGLang servers. They load the model themselves."""
        if self.cfg.engine.type == "torch":
            return self.torch_engines()
        return self.server_engines(eos_token_ids)

    def connect(self, trainer: TrainerGroup, engine: Any) -> Any:
        """The weight sync from the trainer ranks' shards into the group's engines."""
        if self.cfg.engine.type == "torch":
            return self.torch_sync(trainer, engine)
        return self.server_sync(trainer, engine)

    def placement(self) -> Any:
        """Server replicas as `ServerHost` actors on this group's bundles (one per replica, each
        owning its server process on its node)."""
        first = self.first_bundle
        return ray_placement(lambda i: self.cluster.engine_options(first + i))

    def urls(self) -> list[str]:
        """`engine.urls` of this group: the list split evenly between the groups, in role order."""
        urls = list(self.cfg.engine.urls)
        per = len(urls) // self.count
        return urls[self.index * per : (self.index + 1) * per]

    def server_engines(self, eos_token_ids: list[int]) -> ServerEngine:
        """vLLM / SGLang servers placed on the group's bundles (or attached by `engine.urls`);
        servers weir starts load the same files as the trainer."""
        cfg, c = self.cfg, self.cfg.cluster
        gpus = c.engines.gpus
        lora = cfg.lora
        return start_engine_servers(
            cfg.engine.model_copy(update={"replicas": c.engines.replicas, "urls": self.urls()}),
            self.model_path,
            self.work_dir,
            eos_token_ids,
            dtype=engine_dtype(cfg),
            seed=cfg.run.seed + self.index,
            place=self.placement(),
            tensor_parallel_size=max(1, int(gpus)) if gpus >= 1 else 1,
            lora_rank=lora.rank if lora.enabled and lora.sync == "adapter" else None,
        )

    def server_sync(self, trainer: TrainerGroup, engine: ServerEngine) -> ServerSync:
        """The sync from the trainer's shards into the servers. Attached servers are given the
        trainer's weights at once (they may hold others), as are LoRA adapters."""
        cfg, c = self.cfg, self.cfg.cluster
        transport = "broadcast" if c.weight_sync == "auto" else c.weight_sync
        if cfg.lora.enabled and cfg.lora.sync == "adapter":
            transport = "adapter"
        sync = ServerSync(
            trainer,
            engine,
            transport,
            bucket_mb=c.bucket_mb,
            backend=sync_backend(cfg),
            dtype=engine_dtype(cfg),
            disk_dir=c.sync_dir or self.run_dir / "weights" / (self.role or "policy"),
            model_dir=self.model_path,
            role=self.role,
            verify=c.verify_sync,
        )
        if self.urls() or transport == "adapter":
            sync.push(0)
        return sync

    def torch_engines(self) -> Router:
        """weir's own engine as `SyncEngineWorker` actors behind a `Router`."""
        import ray

        cfg, c = self.cfg, self.cfg.cluster
        remote = ray.remote(SyncEngineWorker)
        replicas = [
            remote.options(**self.cluster.engine_options(self.first_bundle + i)).remote(
                cfg.engine,
                self.model_path,
                i,
                load_for_engine,
                seed=cfg.run.seed + self.index * c.engines.replicas,
                on_gpu=c.engines.gpus > 0,
                cudnn_attention=cfg.model.cudnn_attention,
                deterministic=cfg.run.deterministic,
                record_routing=cfg.algo.routing_replay,
            )
            for i in range(c.engines.replicas)
        ]
        ray.get([r.ping.remote() for r in replicas])
        router = Router(replicas, seed=cfg.run.seed + self.index)
        router.sleep_mode = c.colocate and cfg.engine.sleep_while_training
        router.sleep_offload_weights = cfg.engine.sleep_offload_weights
        return router

    def torch_sync(self, trainer: TrainerGroup, router: Router) -> WeightSync:
        """The sync from the trainer's shards into the replicas; a replica Ray restarts gets the
        current weights from it (`router.restore`)."""
        c = self.cfg.cluster
        transport = "broadcast" if c.weight_sync == "auto" else c.weight_sync
        sync = WeightSync(
            trainer,
            router,
            transport,
            disk_dir=c.sync_dir or self.run_dir / "weights" / (self.role or "policy"),
            bucket_mb=c.bucket_mb,
            backend=sync_backend(self.cfg),
            dtype=engine_dtype(self.cfg),
            host_handles=c.colocate,
            role=self.role,
            verify=c.verify_sync,
        )
        router.restore = sync.restore
        return sync


def describe(parts: Any) -> dict[str, float]:
    """Cluster counters for the step metrics: engine retries and restarts."""
    return {
        "cluster/engine_retries": float(parts.router.retries),
        "cluster/engine_restarts": float(parts.router.restarts),
    }
