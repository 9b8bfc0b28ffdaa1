"""Data-parallel training of one `Actor` over a torch.distributed process group, the model sharded
with FSDP2.

Every rank receives the whole `TrainBatch` (advantages are group-relative and cheap, so each rank
computes them identically) and trains on its share of every mini-batch: the rows are dealt to
ranks balanced by token count, and each rank packs its rows into micro-batches. Loss aggregation
already divides by the token / sequence counts of the *whole* mini-batch (weir.algo.aggregation),
so the per-rank losses add up to the one-process loss; FSDP2's reduce-scatter is set to sum
(divide factor 1) instead of averaging, and the gradient equals the one-process gradient:

    grad = sum_r grad(L_r),    L_r = sum_{micro-batches of rank r} loss(mb; N_global, S_global)

FSDP2 runs collectives in every forward and backward, so ranks with fewer micro-batches run
padding passes (a forward of one token with a zero loss) to keep in step.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from weir.train.actor import Actor, ActorSettings
from weir.train.deal import balance, deal_groups
from weir.train.layout_cost import LayoutChoice
from weir.train.packing import (
    Layout,
    exact_layouts,
    micro_batches,
    prefix_refusal,
)
from weir.train.precision import Precision, sharded_precision
from weir.train.prefix_pass import prefix_response_logprobs

log = logging.getLogger(__name__)


def shard_model(
    model: torch.nn.Module,
    *,
    compute_dtype: torch.dtype | None = None,
    offload: bool = False,
    device: torch.device | None = None,
) -> torch.nn.Module:
    """Apply FSDP2 in place: one unit per decoder layer, one for the embedding, final norm and LM
    head together (a tied embedding is one parameter of both), and the root holding nothing else.

    The root holds no parameters because the `prefix` layout runs the model twice before one
    backward, and FSDP2 then left the root's own gradients on its unsharded parameters.

    The shards keep the parameters' dtype (float32 master weights); with `compute_dtype` (e.g.
    bfloat16) FSDP2's MixedPrecisionPolicy casts the gathered parameters to it for the forward and
    backward, and reduces gradients in float32. `offload` keeps parameters, gradients and optimizer
    state in CPU memory between uses (FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU).
    `device`: where the rank computes (default: the parameters' device; a model still on the meta
    device must name it, or the offload is not set up).
    """
    master = next(model.parameters()).dtype
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: LoRA
    kwargs: dict[str, Any] = {}
    if compute_dtype is not None and compute_dtype != master:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32
        )
    on_gpu = (device or next(model.parameters()).device).type == "cuda"  # CPU: on the host already
    kwargs["offload_policy"] = CPUOffloadPolicy() if offload and on_gpu else OffloadPolicy()
    base = getattr(inner, "model", None)
    if hasattr(inner, "backbone"):  # a critic's value model: its backbone's decoder layers
        base = inner.backbone
    visual = getattr(base, "visual", None)  # a vision-language model: its vision tower's blocks
    if getattr(base, "language_model", None) is not None:  # and its language model's layers
        base = base.language_model
    layers = getattr(base, "layers", None)
    for layer in layers or []:
        fully_shard(layer, **kwargs)
    for block in getattr(visual, "blocks", None) or []:
        fully_shard(block, **kwargs)
    ends = [
        m
        for m in (getattr(base, "embed_tokens", None), getattr(base, "norm", None))
        + (getattr(inner, "lm_head", None), getattr(inner, "head", None))
        if isinstance(m, torch.nn.Module) and next(m.parameters(), None) is not None
    ]
    if layers and ends:
        fully_shard(ends, **kwargs)
    fully_shard(model, **kwargs)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # sum the ranks' gradients (module docstring)
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


class ShardedActor(Actor):
    """`Actor` on an FSDP2-sharded model; every rank of the default process group runs one.

    `model` may come sharded already (a meta-device start), and then so does `reference`, the
    frozen initial policy for the KL term; otherwise both are sharded here.
    """

    offload_in_optimizer = False  # FSDP2's CPUOffloadPolicy keeps the optimizer state on the host
    copies_reference = True  # the KL reference is a sharded copy of the initial model (LoRA: none)
    # Collectives stay in step: every rank runs the same number of micro-batches (`_micro_batches`
    # pads with idle ones), each of the same number of model forwards (the prefix layout's two:
    # prompts, then all responses in one pass; `_idle_pass` runs two as well). A fused step
    # restarts on every rank or none (`_all_finite`). The prefix layout deals whole prompt groups
    # to ranks (`deal_groups`), so that each prompt still runs once. `train.packing=auto` runs its
    # exactness probe through the sharded model at the first forward (every rank together; a
    # layer's shards are gathered one unit at a time, as in a training forward), not while the
    # rank loads, and the ranks take `prefix` only if all of them found it exact.
    shares_prompts = True
    defers_layout = True
    prefix_one_pass = True

    def __init__(
        self,
        model: torch.nn.Module,
        settings: ActorSettings,
        reference: torch.nn.Module | None = None,
        teacher: torch.nn.Module | None = None,
    ) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # NCCL reduces tensors on the GPU, gloo on the CPU
        nccl = dist.get_backend() == "nccl"
        self._comm = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        # the reference must be copied before `model` is sharded in place
        if reference is None and settings.needs_reference and self.copies_reference:
            reference = copy.deepcopy(model)
        self._initial = reference
        self._teacher_model = teacher  # a distillation teacher read shard by shard (TrainerRank)
        device = next(model.parameters()).device
        self._compute = Precision.from_config(settings.train, device=device).compute_dtype
        self._offload = settings.train.offload_optimizer
        if not isinstance(model, FSDPModule):
            shard_model(model, compute_dtype=self._compute, offload=self._offload)
        super().__init__(model, settings)
        self._initial = self._teacher_model = None

    def _reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen, sharded copy of the initial model (copied before sharding)."""
        assert self._initial is not None
        ref = self._initial.eval().requires_grad_(False)
        if isinstance(ref, FSDPModule):
            return ref
        return shard_model(ref, compute_dtype=self._compute, offload=self._offload)

    def _load_teacher(self, path: str) -> torch.nn.Module:
        """The distillation teacher as FSDP2 shards, like the reference: the one the rank read shard
        by shard, or else loaded whole on this rank and sharded here."""
        teacher = self._teacher_model
        if teacher is None:
            teacher = super()._load_teacher(path)
        teacher = teacher.eval().requires_grad_(False)
        if isinstance(teacher, FSDPModule):
            return teacher
        return shard_model(teacher, compute_dtype=self._compute, offload=self._offload)

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def _from_first_rank(self, rows: torch.Tensor) -> torch.Tensor:
        out = rows.to(self._comm) if self._comm is not None else rows.clone()
        dist.broadcast(out, src=0)
        return out.to(rows.device)

    def _precision(self, model: torch.nn.Module) -> Precision:
        """`sharded_precision` on the rank's device (with CPU offload the shards live on the
        CPU)."""
        return sharded_precision(model, self._comm)

    def _choose_layouts(self) -> LayoutChoice:
        """`train.packing` resolved on every rank at once: a layout is a candidate only where
        every rank's probe found it exact; a refusal of an asked-for layout is raised on every
        rank, after the ranks agreed, so that none is left waiting in a collective."""
        refusal: ValueError | None = None
        try:
            mine = exact_layouts(
                self.model,
                self.tcfg.packing,
                shared_prompts=self.shares_prompts,
                compute_dtype=self._compute,  # FSDP2's MixedPrecisionPolicy casts the shards
                with_varlen=True,
            )
        except ValueError as err:  # a layout asked for, and this rank's probe refused it
            mine, refusal = ["padded"], err
        self._settle()
        names: list[Layout] = ["packed", "prefix", "varlen", "padded"]
        flags = [0.0 if refusal else 1.0] + [1.0 if n in mine else 0.0 for n in names]
        agreed = torch.tensor(flags)
        agreed = agreed.to(self._comm) if self._comm is not None else agreed
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        ok = agreed.tolist()
        if ok[0] < 1.0:
            packing = self.tcfg.packing
            raise refusal or (
                prefix_refusal("another trainer rank's probe found it inexact")
                if packing == "prefix"
                else ValueError(
                    f"train.packing={packing}: another trainer rank's probe found it inexact; "
                    "set train.packing=auto or padded"
                )
            )
        layouts = [n for n in mine if ok[1 + names.index(n)] >= 1.0]
        if layouts != mine:
            log.info("train.packing=auto: %s (another rank's probe refused the rest)", layouts)
        return self._layout_choice(layouts)

    def _micro_batches(
        self,
        indices: list[int],
        seqs: list[list[int]],
        lens: list[int] | None = None,
        layout: Layout | None = None,
    ) -> list[list[int]]:
        layout = layout or self.layout
        prefix = layout == "prefix" and lens is not None
        if prefix:
            mine = deal_groups(indices, seqs, lens, self.world)[self.rank]
        else:
            lengths = [len(seqs[i]) for i in indices]
            mine = [indices[p] for p in balance(lengths, self.world)[self.rank]]
        local = [
            [mine[j] for j in mb]
            for mb in micro_batches(
                [len(seqs[i]) for i in mine],
                self.tcfg.micro_batch_tokens,
                layout,
                sequences=[seqs[i] for i in mine] if prefix else None,
                response_lengths=[lens[i] for i in mine] if prefix else None,
            )
        ]
        if self.world == 1:
            return local
        count = torch.tensor([len(local)], device=self._comm)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return local + [[]] * (int(count.item()) - len(local))

    def _idle_pass(
        self, model: torch.nn.Module, *, backward: bool, layout: Layout | None = None
    ) -> None:
        with torch.set_grad_enabled(backward):
            if (
                layout or self.layout
            ) == "prefix":  # the same two forwards as a real prefix micro-batch
                out = prefix_response_logprobs(model, [[0, 0]], [1], one_pass=True).logprobs
            else:
                ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
                out = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        if backward:
            (out.float().sum() * 0.0).backward()

    def _settle(self) -> None:
        # FSDP2 keeps the root module unsharded after a forward (its backward would gather it
        # again); with no backward to come, reshard it so that its parameters are DTensors again
        if isinstance(self.model, FSDPModule):
            self.model.reshard()

    # one rank (a colocated trainer on one GPU): what the collectives below would agree on is
    # its own answer, so it takes none of them (each is a host synchronisation)

    def _all_finite(self, finite: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return finite
        flag = finite.reshape(1).float()
        flag = flag.to(self._comm) if self._comm is not None else flag
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return flag[0] > 0

    def _combine_rows(self, rows: torch.Tensor) -> torch.Tensor:
        # each row was computed on exactly one rank, zeros elsewhere
        if self.world == 1:
            return rows
        total = rows.to(self._comm) if self._comm is not None else rows
        dist.all_reduce(total)
        return total.to(rows.device)

    def _reduce_metrics(
        self, sums: dict[str, float], peaks: dict[str, float]
    ) -> tuple[dict[str, float], dict[str, float]]:
        if self.world == 1:
            return sums, peaks
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
