"""Trainer ranks: the processes that train one model together, and the driver's handle on them.

`TrainerRank` is the process-level object a Ray actor wraps (weir.cluster makes the actors): it
joins the group, builds the sharded actor (`weir.train.sharded_actor`, which says how the ranks
split a batch and sum their gradients) on the meta device and reads only its own shard of the
weights (weir.train.meta_init), trains, gathers full weights for the engines, and saves / loads
sharded checkpoints with torch.distributed.checkpoint (weir.train.sharded_checkpoint).
`TrainerGroup` is the driver's side: it calls every rank and returns rank 0's answer.

A group of one rank (a colocated trainer on one GPU) trains the plain `Actor`, the very step of
`cluster.type=local`, rather than FSDP2 over a world of one (`shards_model`): the same checkpoints
(DCP reshards whole tensors into N ranks' shards and back), weight sync and offload. (A LoRA
policy and a critic are FSDP2-sharded on any group, one rank included: weir.train.rank_build.)
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from weir.config import Config
from weir.config.sections import ClusterConfig, LoraConfig, TrainConfig
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import TrainBatch
from weir.train.precision import Precision, setup_device
from weir.train.sharded_checkpoint import load_shards, save_shards

if TYPE_CHECKING:
    from weir.train.critic import CriticSettings

log = logging.getLogger(__name__)
PEER_GRACE_S = 10.0
"""How long a rank's error waits for the other ranks to report a death that caused it."""


def _by_name(optim: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A one-process `optimizer.state_dict()` (parameters numbered in `model.parameters()` order)
    keyed by parameter name, as `set_optimizer_state_dict` reads it; a named one is returned as is."""
    if not all(isinstance(k, int) for k in optim.get("state", {})):
        return optim
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]]
    return {"state": {names[i]: v for i, v in optim["state"].items()}, "param_groups": groups}


def free_port() -> int:
    """A TCP port that is free on this node now (for a rendezvous this process hosts)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def shards_model(world: int, train: TrainConfig) -> bool:
    """Whether a trainer group of `world` ranks shards its model with FSDP2.

    One rank does not: FSDP2 over a world of one computes the plain `Actor`'s step and adds its
    own work to it (each layer's parameters copied and cast in the forward and again in the
    backward, gradients cast and passed through the reduction, DTensor dispatch in the optimizer,
    its hooks; on an H200 its step took 1.95x the local one, docs/gpu.md), where the plain `Actor`
    is the local step itself. Except with `train.offload_optimizer`: the plain actor's
    `OffloadedAdamW` steps host copies of the parameters, which torch.distributed.checkpoint
    cannot name, where FSDP2's CPU offload keeps checkpoints and trainer state by name."""
    return world > 1 or train.offload_optimizer


@dataclass(frozen=True)
class RankSettings:
    """What a trainer rank needs from the run's config: the actor's settings, the cluster's
    layout (devices per rank, colocation, offload), threads, seed, determinism and whether cuDNN
    attention is allowed."""

    actor: ActorSettings
    cluster: ClusterConfig
    threads: int = 1
    seed: int = 0
    deterministic: bool = False
    cudnn_attention: bool = False
    lora: LoraConfig | None = None  # lora.enabled: adapters on every policy (weir.train.rank_build)
    critic: CriticSettings | None = None  # algo.advantage=gae: a critic per policy
    critic_path: str | None = None  # critic.model_path, resolved by the driver
    roles: tuple[tuple[str, str], ...] = ()  # policies=separate: (role, its model directory)

    @property
    def train(self) -> TrainConfig:
        return self.actor.train

    @classmethod
    def from_config(cls, cfg: Config) -> RankSettings:
        """The settings of `cfg`; model paths of roles and critic (`roles`, `critic_path`) are
        the driver's to resolve and add (`dataclasses.replace`)."""
        from weir.train.critic import CriticSettings

        return cls(
            actor=ActorSettings.from_config(cfg),
            cluster=cfg.cluster,
            threads=cfg.model.threads or 1,
            seed=cfg.run.seed,
            deterministic=cfg.run.deterministic,
            cudnn_attention=cfg.model.cudnn_attention,
            lora=cfg.lora if cfg.lora.enabled else None,
            critic=CriticSettings.from_config(cfg) if cfg.algo.advantage == "gae" else None,
        )


class TrainerRank:
    """One trainer process: joins the group, trains its share, serves weights and checkpoints.

    Args:
        settings: its config sections (`RankSettings.from_config(cfg)`; cluster.trainer says
            ranks and devices).
        model_path: the model directory every rank loads (identical initial weights).
        rank, world: this process's place in the trainer group.
    """

    def __init__(self, settings: RankSettings, model_path: str, rank: int, world: int) -> None:
        self.settings, self.model_path, self.rank, self.world = settings, model_path, rank, world
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU, so it is always cuda:0 here
        self.device = "cuda:0" if settings.cluster.trainer.gpus_per_rank > 0 else "cpu"
        torch.set_num_threads(settings.threads)
        self.sharded = shards_model(world, settings.train)
        self.policies: dict[str, Actor] = {}  # "" for the one policy, else by role
        self.critics: dict[str, Any] = {}  # algo.advantage=gae: each policy's critic
        self.start: dict[str, float] = {}

    @property
    def actor(self) -> Actor | None:
        """The policy of a run with one (the first role's with separate policies)."""
        return next(iter(self.policies.values()), None)

    def policy(self, role: str = "") -> Actor:
        """The policy of `role` ("" with one policy)."""
        try:
            return self.policies[role]
        except KeyError:
            raise KeyError(f"trainer rank {self.rank} has no policy {role!r}") from None

    def address(self) -> tuple[str, int]:
        """Rank 0's rendezvous address (this node's IP and a free port)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, host: str, port: int) -> int:
        """Join the trainer group and build the policies (and critics); returns this rank. A
        full-weight policy is sharded unless the group is one rank (`shards_model`); LoRA
        policies and critics are always FSDP2-sharded (weir.train.rank_build)."""
        from weir.train.rank_build import build_critic, build_policy

        on_gpu = self.device.startswith("cuda")
        backend = "nccl" if on_gpu else "gloo"
        precision = Precision.from_config(self.settings.train, device=self.device)
        setup_device(
            precision,
            deterministic=self.settings.deterministic,
            cudnn_attention=self.settings.cudnn_attention,
        )
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world,
        )
        # NCCL builds its communicator at the first collective: here, not in the first step
        dist.barrier()
        torch.manual_seed(self.settings.seed)
        dtype = precision.param_dtype
        paths = dict(self.settings.roles) or {"": self.model_path}
        for role, path in paths.items():
            self.policies[role] = build_policy(self, path, dtype)
            if self.settings.critic is not None:
                self.critics[role] = build_critic(self, path, dtype)
        return self.rank

    def start_stats(self) -> dict[str, float]:
        """How this rank started: `sharded` (1: FSDP2, 0: the plain `Actor` of a group of one
        rank), `meta` (1: meta device, 0: whole model loaded), `peak_rss_mb`
        (peak resident memory growth while building the actor), `shard_mb` (its weight shard),
        `read_mb` (bytes read from the model files)."""
        return dict(self.start)

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One RL step: the policy (with its critic), or each role's on that role's rows."""
        assert self.policies, "setup() first"
        if self.settings.roles:
            from weir.train.role_trainer import RoleTrainer

            return RoleTrainer(self.policies, self.critics).train(batch)
        return self.policy().train(batch, critic=self.critics.get(""))

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) CPU weights on rank 0, {} elsewhere; every rank must call it."""
        assert self.actor is not None
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.actor.model, options=opts)

    def trainer_state(self) -> dict[str, Any]:
        """Collective: rank 0 returns the full (unsharded) optimizer state, schedule, KL
        coefficient and counters, the same keys as `Actor.state_dict`; other ranks {}."""
        assert self.actor is not None
        a = self.actor
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        _, optim = get_state_dict(a.model, a.optimizer, options=opts)
        if self.rank != 0:
            return {}
        return {
            "optimizer": optim,
            "scheduler": a.scheduler.state_dict(),
            "kl_coef": a.kl_ctl.value,
            "updates": a.updates,
            "skipped_updates": a.skipped_updates,
        }

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """Every rank: shard a full `trainer_state` (and full weights under "model") back in."""
        assert self.actor is not None
        a = self.actor
        opts = StateDictOptions(full_state_dict=True)
        if "model" in state:
            set_state_dict(
                a.model,
                a.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=opts,
            )
        else:
            optim = _by_name(state["optimizer"], [n for n, _ in a.model.named_parameters()])
            set_optimizer_state_dict(a.model, a.optimizer, optim, options=opts)
        a.scheduler.load_state_dict(state["scheduler"])
        a.kl_ctl.value = state["kl_coef"]
        a.updates, a.skipped_updates = state["updates"], state["skipped_updates"]

    def load_hf(self, model_dir: str) -> None:
        """Every rank: read its slice of every weight from an HF directory (the `model/` of a
        one-process run's checkpoint), as the meta-device start reads the initial weights."""
        from weir.train.meta_init import disk_layout, layout_mismatch, load_local_shards

        assert self.actor is not None
        layout = disk_layout(model_dir)
        why = layout_mismatch(self.actor.model, layout)
        if why is not None:
            raise ValueError(
                f"{model_dir} cannot be read shard by shard ({why}); resume this checkpoint with "
                "cluster.type=local"
            )
        load_local_shards(self.actor.model, layout)

    def pid(self) -> int:
        return os.getpid()

    def save(self, path: str) -> dict[str, dict[str, Any]]:
        """Sharded checkpoint of model, optimizer, schedule and counters: every rank writes its own
        shards and returns their manifest entries (weir.train.sharded_checkpoint)."""
        assert self.policies, "setup() first"
        policies = self.policies if self.settings.roles else self.policy()
        return save_shards(policies, path, self.rank, self.critics)

    def load(self, path: str) -> None:
        """Restore what `save` wrote (the same number of ranks or not: DCP reshards)."""
        assert self.policies, "setup() first"
        policies = self.policies if self.settings.roles else self.policy()
        load_shards(policies, path, self.critics)

    def save_hf(self, out: str, bucket_mb: float, role: str = "") -> list[str]:
        """Collective: the current weights of `role`'s policy as HF safetensors files in `out`,
        gathered one tensor at a time and written by rank 0 in files of about `bucket_mb`; returns
        the files (rank 0)."""
        from weir.train.meta_init import disk_layout, layout_mismatch, write_hf_weights

        model = self.policy(role).model
        path = dict(self.settings.roles).get(role, self.model_path)
        layout = disk_layout(path) if Path(path).is_dir() else {}
        if layout_mismatch(model, layout) is None:
            return write_hf_weights(
                model, out, write=self.rank == 0, bucket_bytes=int(bucket_mb * 2**20)
            )
        # the HF layout differs from the module's: let transformers convert a whole copy
        state = self.full_state()
        if self.rank != 0:
            return []
        from weir.train.meta_init import build_on_meta, materialize

        whole = build_on_meta(path, next(iter(state.values())).dtype)
        materialize(whole, "cpu")
        whole.load_state_dict(state)
        whole.save_pretrained(out, safe_serialization=True)
        return sorted(p.name for p in Path(out).iterdir())

    def close(self) -> None:
        """Leave the process group with the other ranks (collective): a barrier first, so that no
        rank tears its connections down while another is still working (the two-rank checkpoint
        test's ranks, where rank 0 still writes a file when rank 1 closes, aborted at exit now and
        then: SIGABRT, "terminate called without an active exception")."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class TrainerGroup:
    """The driver's handle on N trainer ranks (Ray actors placed by a `RayCluster`).

    `train`, `weights`, `save` and `load` call every rank (FSDP2 collectives need them all) and
    return rank 0's answer. A rank that dies ends the call with `TrainerFailed` naming it, even
    while the other ranks wait in a collective.
    """

    def __init__(
        self, cluster, settings: RankSettings, model_path: str, rank_cls: type = TrainerRank
    ) -> None:
        import ray

        self.cluster = settings.cluster
        self.trained = 0  # train calls so far (a weight sync checks whether the weights moved)
        self._collective = threading.RLock()  # one collective call at a time, from any thread
        world = settings.cluster.trainer.ranks
        remote = ray.remote(rank_cls)
        self.ranks = [
            remote.options(**cluster.trainer_options(r)).remote(settings, model_path, r, world)
            for r in range(world)
        ]
        host, port = self.get([self.ranks[0].address.remote()])[0]
        self.call("setup", host, port)

    @property
    def rank0(self):
        return self.ranks[0]

    def get(self, refs: list) -> list:
        """Results of `refs` (one per rank, in rank order); fail fast on the first dead rank.

        A rank's error in a collective (gloo's "connection reset by peer") is often the echo of
        another rank's death: before raising it, the others get `PEER_GRACE_S` to report theirs,
        and a dead rank is what the run stops on."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except RayActorError as err:
                self._died(index[ready[0]], err)
            except RayTaskError:
                if pending:
                    done, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_GRACE_S)
                    for ref in done:
                        try:
                            ray.get(ref)
                        except RayActorError as err:
                            self._died(index[ref], err)
                        except RayTaskError:
                            pass
                raise
        return ray.get(refs)

    def _died(self, rank: int, err: Exception) -> None:
        from weir.cluster import TrainerFailed

        self.shutdown()
        raise TrainerFailed(
            f"trainer rank {rank} died ({type(err).__name__}); the run stops. "
            "Check that rank's log above (out of memory?) and resume from the last checkpoint"
        ) from None

    def call(self, method: str, *args) -> list:
        """`method` on every rank (a collective: calls from several threads do not interleave)."""
        with self._collective:
            return self.get([getattr(r, method).remote(*args) for r in self.ranks])

    def collective(self, submit) -> list:
        """`submit(rank_index, rank_actor) -> ref` for every rank, then their results, as one
        collective call (see `call`)."""
        with self._collective:
            return self.get([submit(i, r) for i, r in enumerate(self.ranks)])

    def train(self, batch: TrainBatch, critic: None = None) -> dict[str, float]:
        if critic is not None:  # the config refuses algo.advantage=gae on Ray
            raise ValueError(
                "a critic on Ray trainer ranks is not supported: use cluster.type=local"
            )
        import ray

        ref = ray.put(batch)  # one copy in the object store, read by every rank
        self.trained += 1
        return self.call("train", ref)[0]

    def weights(self):
        """Full weights (fetched to this process): for saving the final model."""
        return self.call("full_state")[0].items()

    def state_dict(self) -> dict:
        """Full optimizer state, schedule and counters (as `Actor.state_dict`), for a checkpoint."""
        return self.call("trainer_state")[0]

    def load_state_dict(self, state: dict) -> None:
        """Put a `state_dict` back on every rank; with full weights under "model" those too."""
        import ray

        self.call("load_trainer_state", ray.put(state))

    def save(self, path: str) -> dict[str, dict[str, Any]]:
        """Sharded DCP checkpoint of model, optimizer and schedule: every rank writes and hashes
        its part in parallel; returns the manifest entries of every rank's files."""
        entries: dict[str, dict[str, Any]] = {}
        for part in self.call("save", str(path)):
            entries.update(part)
        return entries

    def load(self, path: str) -> None:
        self.call("load", str(path))

    def save_hf(self, out: str, bucket_mb: float = 512.0, role: str = "") -> list[str]:
        """The current weights (of `role`'s policy) as HF safetensors files in `out` (no config,
        no tokenizer)."""
        return self.call("save_hf", str(out), bucket_mb, role)[0]

    def start_stats(self) -> list[dict[str, float]]:
        """Each rank's `TrainerRank.start_stats`, in rank order."""
        return self.call("start_stats")

    def shutdown(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)
        self.ranks = []
