"""Data-parallel training over one torch.distributed process group, the model sharded with FSDP2.

Every rank receives the whole `TrainBatch` (advantages are group-relative and cheap, so each rank
computes them identically) and trains on its share of every mini-batch: the rows are dealt to
ranks balanced by token count, and each rank packs its rows into micro-batches. Loss aggregation
already divides by the token / sequence counts of the *whole* mini-batch (weir.algo.aggregation),
so the per-rank losses add up to the one-process loss; FSDP2's reduce-scatter is set to sum
(divide factor 1) instead of averaging, and the gradient equals the one-process gradient:

    grad = sum_r grad(L_r),    L_r = sum_{micro-batches of rank r} loss(mb; N_global, S_global)

FSDP2 runs collectives in every forward and backward, so ranks with fewer micro-batches run
padding passes (a forward of one token with a zero loss) to keep in step.

`TrainerRank` is the process-level object a Ray actor wraps (weir.cluster makes the actors): it
joins the group, builds the sharded actor, trains, gathers full weights for the engines, and
saves / loads sharded checkpoints with torch.distributed.checkpoint (DCP).
"""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from weir.config import Config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import TrainBatch
from weir.train.packing import micro_batches
from weir.train.precision import Precision, setup_device


def shard_model(
    model: torch.nn.Module,
    *,
    compute_dtype: torch.dtype | None = None,
    offload: bool = False,
) -> torch.nn.Module:
    """Apply FSDP2 in place: one unit per decoder layer, the rest (embeddings, head) in the root.

    The shards keep the parameters' dtype (float32 master weights); with `compute_dtype` (e.g.
    bfloat16) FSDP2's MixedPrecisionPolicy casts the gathered parameters to it for the forward and
    backward, and reduces gradients in float32. `offload` keeps parameters, gradients and optimizer
    state in CPU memory between uses (FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU).
    """
    master = next(model.parameters()).dtype
    kwargs: dict[str, Any] = {}
    if compute_dtype is not None and compute_dtype != master:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32
        )
    on_gpu = next(model.parameters()).is_cuda  # on the CPU the state is on the host already
    kwargs["offload_policy"] = CPUOffloadPolicy() if offload and on_gpu else OffloadPolicy()
    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers or []:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # sum the ranks' gradients (module docstring)
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def balance(lengths: list[int], ranks: int) -> list[list[int]]:
    """Deal positions to `ranks` bins, longest first into the bin with the fewest tokens so far.

    Deterministic (ties go to the lower rank, equal lengths keep their order); each bin is
    returned in increasing position order.
    """
    bins: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for pos in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        bins[r].append(pos)
        load[r] += lengths[pos]
    return [sorted(b) for b in bins]


class ShardedActor(Actor):
    """`Actor` on an FSDP2-sharded model; every rank of the default process group runs one."""

    offload_in_optimizer = False  # FSDP2's CPUOffloadPolicy keeps the optimizer state on the host
    # single-process shortcuts: the prefix layout's two forwards per micro-batch are untested
    # under FSDP2, and a restarted step or a rank without backward would put collectives out of step
    shares_prompts = fuses_old_logprobs = skips_dead_backward = False

    def __init__(self, model: torch.nn.Module, settings: ActorSettings) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # NCCL reduces tensors on the GPU, gloo on the CPU
        nccl = dist.get_backend() == "nccl"
        self._comm = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        # the reference must be copied before `model` is sharded in place
        self._initial = copy.deepcopy(model) if settings.algo.kl.coef > 0 else None
        device = next(model.parameters()).device
        self._compute = Precision.from_config(settings.train, device=device).compute_dtype
        self._offload = settings.train.offload_optimizer
        shard_model(model, compute_dtype=self._compute, offload=self._offload)
        super().__init__(model, settings)
        self._initial = None

    def _reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen, sharded copy of the initial model (copied before sharding)."""
        assert self._initial is not None
        ref = self._initial.eval().requires_grad_(False)
        return shard_model(ref, compute_dtype=self._compute, offload=self._offload)

    def _precision(self, model: torch.nn.Module) -> Precision:
        """FSDP2's MixedPrecisionPolicy casts the gathered shards, so no autocast on top of it.

        The device is the rank's (with CPU offload the shards themselves live on the CPU)."""
        p = next(model.parameters())
        device = self._comm if self._comm is not None else p.device
        return Precision(device, p.dtype, p.dtype)

    def _micro_batches(
        self, indices: list[int], seqs: list[list[int]], lens: list[int] | None = None
    ) -> list[list[int]]:
        mine = [indices[p] for p in balance([len(seqs[i]) for i in indices], self.world)[self.rank]]
        local = [
            [mine[j] for j in mb]
            for mb in micro_batches(
                [len(seqs[i]) for i in mine], self.tcfg.micro_batch_tokens, self.layout
            )
        ]
        count = torch.tensor([len(local)], device=self._comm)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return local + [[]] * (int(count.item()) - len(local))

    def _idle_pass(self, model: torch.nn.Module, *, backward: bool) -> None:
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(backward):
            out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
        if backward:
            (out.logits.float().sum() * 0.0).backward()

    def _combine_rows(self, rows: torch.Tensor) -> torch.Tensor:
        # each row was computed on exactly one rank, zeros elsewhere
        total = rows.to(self._comm) if self._comm is not None else rows
        dist.all_reduce(total)
        return total.to(rows.device)

    def _reduce_metrics(
        self, sums: dict[str, float], peaks: dict[str, float]
    ) -> tuple[dict[str, float], dict[str, float]]:
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, (dict(sums), dict(peaks)))
        total: dict[str, float] = {}
        top: dict[str, float] = {}
        for s, p in parts:
            for k, v in s.items():
                total[k] = total.get(k, 0.0) + v
            for k, v in p.items():
                top[k] = max(top.get(k, float("-inf")), v)
        return total, top


def free_port() -> int:
    """A TCP port that is free on this node now (for a rendezvous this process hosts)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class TrainerRank:
    """One trainer process: joins the group, trains its share, serves weights and checkpoints.

    Args:
        cfg: the run config (cfg.cluster.trainer says ranks and devices).
        model_path: the model directory every rank loads (identical initial weights).
        rank, world: this process's place in the trainer group.
    """

    def __init__(self, cfg: Config, model_path: str, rank: int, world: int) -> None:
        self.cfg, self.model_path, self.rank, self.world = cfg, model_path, rank, world
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU, so it is always cuda:0 here
        self.device = "cuda:0" if cfg.cluster.trainer.gpus_per_rank > 0 else "cpu"
        torch.set_num_threads(cfg.model.threads or 1)
        self.actor: ShardedActor | None = None

    def address(self) -> tuple[str, int]:
        """Rank 0's rendezvous address (this node's IP and a free port)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, host: str, port: int) -> int:
        """Join the trainer group and build the sharded actor; returns this rank."""
        from weir.train.model import load_model

        on_gpu = self.device.startswith("cuda")
        backend = "nccl" if on_gpu else "gloo"
        precision = Precision.from_config(self.cfg.train, device=self.device)
        setup_device(precision, deterministic=self.cfg.run.deterministic)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world,
        )
        torch.manual_seed(self.cfg.run.seed)
        model, _ = load_model(self.model_path, precision.param_dtype, self.device)
        self.actor = ShardedActor(model, ActorSettings.from_config(self.cfg))
        return self.rank

    def train(self, batch: TrainBatch) -> dict[str, float]:
        assert self.actor is not None, "setup() first"
        return self.actor.train(batch)

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
            set_optimizer_state_dict(a.model, a.optimizer, state["optimizer"], options=opts)
        a.scheduler.load_state_dict(state["scheduler"])
        a.kl_ctl.value = state["kl_coef"]
        a.updates, a.skipped_updates = state["updates"], state["skipped_updates"]

    def pid(self) -> int:
        return os.getpid()

    def _dcp_state(self) -> dict:
        """This rank's shards of model and optimizer, plus schedule and update count: what DCP saves,
        and the template it loads into."""
        assert self.actor is not None
        model_sd, optim_sd = get_state_dict(self.actor.model, self.actor.optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": self.actor.scheduler.state_dict(),
            "updates": self.actor.updates,
        }

    def save(self, path: str) -> None:
        """Sharded checkpoint of model and optimizer (every rank writes its shards) with DCP."""
        dcp.save(self._dcp_state(), checkpoint_id=str(Path(path)))

    def load(self, path: str) -> None:
        """Restore what `save` wrote (the same number of ranks or not: DCP reshards)."""
        state = self._dcp_state()
        dcp.load(state, checkpoint_id=str(Path(path)))
        set_state_dict(
            self.actor.model,
            self.actor.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.actor.scheduler.load_state_dict(state["scheduler"])
        self.actor.updates = int(state["updates"])

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup:
    """The driver's handle on N trainer ranks (Ray actors placed by a `RayCluster`).

    `train`, `weights`, `save` and `load` call every rank (FSDP2 collectives need them all) and
    return rank 0's answer. A rank that dies ends the call with `TrainerFailed` naming it, even
    while the other ranks wait in a collective.
    """

    def __init__(self, cluster, cfg: Config, model_path: str, rank_cls: type = TrainerRank) -> None:
        import ray

        self.cfg = cfg
        world = cfg.cluster.trainer.ranks
        remote = ray.remote(rank_cls)
        self.ranks = [
            remote.options(**cluster.trainer_options(r)).remote(cfg, model_path, r, world)
            for r in range(world)
        ]
        host, port = self.get([self.ranks[0].address.remote()])[0]
        self.call("setup", host, port)

    @property
    def rank0(self):
        return self.ranks[0]

    def get(self, refs: list) -> list:
        """Results of `refs` (one per rank, in rank order); fail fast on the first dead rank."""
        import ray
        from ray.exceptions import RayActorError

        from weir.cluster import TrainerFailed

        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except RayActorError as err:
                self.shutdown()
                raise TrainerFailed(
                    f"trainer rank {index[ready[0]]} died ({type(err).__name__}); the run stops. "
                    "Check that rank's log above (out of memory?) and resume from the last checkpoint"
                ) from None
        return ray.get(refs)

    def call(self, method: str, *args) -> list:
        return self.get([getattr(r, method).remote(*args) for r in self.ranks])

    def train(self, batch: TrainBatch) -> dict[str, float]:
        import ray

        ref = ray.put(batch)  # one copy in the object store, read by every rank
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

    def save(self, path: str) -> None:
        """Sharded DCP checkpoint of model, optimizer and schedule (every rank writes its part)."""
        self.call("save", str(path))

    def load(self, path: str) -> None:
        self.call("load", str(path))

    def shutdown(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)
        self.ranks = []
