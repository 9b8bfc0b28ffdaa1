"""PPO's critic on FSDP2 trainer ranks, data-parallel like the actor (weir.train.sharded_actor).

Every rank holds the value model sharded with FSDP2 (its own parameters, beside the actor's on the
same ranks and process group) and receives the whole batch. Values: each rank computes its share of
the rows (dealt by token count) and the ranks sum their (B, T) tensors, each row non-zero on exactly
one rank, so every rank has every value. Training: the value loss is normalised by the token count
of the whole mini-batch, so the ranks' losses add up to the one-process loss and FSDP2 sums their
gradients (divide factor 1), as for the actor:

    grad = sum_r grad(L_r),    L_r = sum_{micro-batches of rank r} value_loss(mb; N_global)

A rank with fewer micro-batches runs idle passes (one token, zero loss) so that FSDP2's
collectives stay in step. Micro-batches are padded rows (`padded` layout): always exact, and it
needs no probe forward while the ranks load.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from weir.train.critic import Critic, CriticSettings, ValueModel
from weir.train.deal import balance
from weir.train.packing import Layout, micro_batches
from weir.train.precision import Precision, sharded_precision
from weir.train.sharded_actor import shard_model


class ShardedCritic(Critic):
    """`Critic` on an FSDP2-sharded `ValueModel`; every rank of the default process group runs
    one (see the module docstring)."""

    def __init__(self, model: ValueModel, settings: CriticSettings) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        nccl = dist.get_backend() == "nccl"
        self._comm = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        if not isinstance(model, FSDPModule):
            p = next(model.parameters())
            compute = Precision.from_config(settings.train, device=p.device).compute_dtype
            shard_model(model, compute_dtype=compute)
        super().__init__(model, settings)

    def _precision(self, model: torch.nn.Module) -> Precision:
        """`sharded_precision`: FSDP2 casts the gathered shards, no autocast or compute copy."""
        return sharded_precision(model)

    def _choose_layout(self, model: ValueModel) -> Layout:
        return "padded"

    def values(self, batch, mask):
        out = super().values(batch, mask)
        if isinstance(self.model, FSDPModule):
            self.model.reshard()  # no backward followed the forwards: shard the root again
        return out

    def _micro_batches(self, indices: list[int], seqs: list[list[int]]) -> list[list[int]]:
        lengths = [len(seqs[i]) for i in indices]
        mine = [indices[p] for p in balance(lengths, self.world)[self.rank]]
        local = [
            [mine[j] for j in mb]
            for mb in micro_batches(
                [len(seqs[i]) for i in mine], self.tcfg.micro_batch_tokens, self.layout
            )
        ]
        count = torch.tensor([len(local)], device=self._comm)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return local + [[]] * (int(count.item()) - len(local))

    def _idle_pass(self, backward: bool) -> None:
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(backward), self.precision.autocast():
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids))
        if backward:
            (out.float().sum() * 0.0).backward()
        elif isinstance(self.model, FSDPModule):
            self.model.reshard()  # no backward follows: shard the root's parameters again

    def _combine_rows(self, rows: torch.Tensor) -> torch.Tensor:
        total = rows.to(self._comm) if self._comm is not None else rows
        dist.all_reduce(total)
        return total.to(rows.device)

    def _reduce(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._comm)
        dist.all_reduce(t)
        return t.tolist()

    def _all_finite(self, finite: bool) -> bool:
        flag = torch.tensor([1.0 if finite else 0.0], device=self._comm)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() > 0)
