"""What one trainer rank trains, built on that rank: the policy (or one per role), its LoRA adapters,
its critic. The features live here, in the rank, so they run under every placement: one process is
the degenerate case of the same pieces (weir.loop.components).

- **policy**: started on the meta device, FSDP2-sharded, and only this rank's slice of every weight
  read from the model's files (weir.train.meta_init); a model whose loading converts tensors is
  loaded whole and then sharded. A group of one rank trains the plain `Actor` instead
  (`weir.train.distributed.shards_model`), every weight read straight onto its device.
- **LoRA** (`lora.enabled`): peft adapters go on before the model is sharded, so the rank loads the
  base model whole (peft wraps a materialised model), applies the adapters with the run's seed (the
  same A as one process), then shards the PeftModel (weir.train.sharded_lora).
- **critic** (`algo.advantage=gae`): a value model of its own on the same ranks and process group,
  sharded like the policy (weir.train.sharded_critic): a copy of the policy's initial backbone, or
  `critic.model_path`'s, with a zero-initialised value head.
- **separate policies** (`multi_agent.policies=separate`): one policy (and critic) per role, each
  from its role's model, all sharded over the same ranks; the rank trains each on its role's rows
  (`weir.train.role_trainer.RoleTrainer`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from weir.train.actor import Actor
from weir.train.memory import peak_rss_since, reset_peak_rss
from weir.train.precision import Precision
from weir.train.sharded_actor import ShardedActor, shard_model


def build_policy(rank: Any, model_path: str, dtype: torch.dtype) -> Actor:
    """Trainer rank `rank`'s policy from `model_path` (`rank.settings`, `rank.device`,
    `rank.sharded`; `rank.start` gets how it started: see `TrainerRank.start_stats`)."""
    from weir.train.meta_init import build_on_meta, disk_layout, layout_mismatch

    settings = rank.settings
    if settings.lora is not None:
        return _lora_policy(rank, model_path, dtype)
    layout = disk_layout(model_path) if Path(model_path).is_dir() else {}
    model = build_on_meta(model_path, dtype)  # imports the model's code, holds no weights
    why = layout_mismatch(model, layout)
    rank.start["sharded"] = float(rank.sharded)
    baseline = reset_peak_rss()
    try:
        if why is None:
            return _from_shards(rank, model_path, model, layout)
        print(
            f"weir: trainer rank {rank.rank} loads the whole model ({why}); "
            "the meta-device start reads only a rank's shard",
            file=sys.stderr,
        )
        from weir.train.model import load_model

        rank.start["meta"] = 0.0
        return _actor(rank, load_model(model_path, dtype, rank.device)[0])
    finally:
        rank.start["peak_rss_mb"] = peak_rss_since(baseline) / 2**20


def _from_shards(rank: Any, model_path: str, model: torch.nn.Module, layout: dict) -> Actor:
    from weir.train.meta_init import build_on_meta, load_local_shards, materialize

    settings = rank.settings
    compute = Precision.from_config(settings.train, device=rank.device).compute_dtype
    offload = settings.train.offload_optimizer
    where = "cpu" if offload else rank.device  # FSDP2's CPU offload keeps shards on the host
    dtype = next(model.parameters()).dtype
    read = 0

    def start(meta: torch.nn.Module) -> torch.nn.Module:
        nonlocal read
        if rank.sharded:
            shard_model(
                meta, compute_dtype=compute, offload=offload, device=torch.device(rank.device)
            )
        materialize(meta, where)
        read += load_local_shards(meta, layout)
        return meta

    actor_model = start(model)
    reference = teacher = None
    if rank.sharded:  # the frozen initial policy, sharded and read alike; a teacher too
        if settings.actor.needs_reference:
            reference = start(build_on_meta(model_path, dtype)).eval().requires_grad_(False)
        teacher = _teacher_shards(rank, dtype, compute, offload, where)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in actor_model.parameters()]
    rank.start.update(meta=1.0, read_mb=read / 2**20, shard_mb=sum(t.nbytes for t in local) / 2**20)
    return _actor(rank, actor_model, reference, teacher)


def _actor(
    rank: Any,
    model: torch.nn.Module,
    reference: torch.nn.Module | None = None,
    teacher: torch.nn.Module | None = None,
) -> Actor:
    """The rank's actor on `model`: sharded, or on a group of one rank the plain `Actor` (which
    copies its reference and loads its teacher itself, as in one process)."""
    if not rank.sharded:
        return Actor(model, rank.settings.actor)
    return ShardedActor(model, rank.settings.actor, reference=reference, teacher=teacher)


def _teacher_shards(
    rank: Any, dtype: torch.dtype, compute: torch.dtype, offload: bool, where: str
) -> torch.nn.Module | None:
    """A distillation teacher from a model directory, started on the meta device with only this
    rank's shard read, as the policy and the reference are (None: no such teacher, or one whose
    loading converts weights, which `ShardedActor` then loads whole and shards)."""
    from weir.train.meta_init import (
        build_on_meta,
        disk_layout,
        layout_mismatch,
        load_local_shards,
        materialize,
    )
    from weir.train.teacher import is_endpoint

    path = rank.settings.actor.teacher
    if path is None or path == "reference" or is_endpoint(path) or not Path(path).is_dir():
        return None
    layout = disk_layout(path)
    teacher = build_on_meta(path, dtype)
    if layout_mismatch(teacher, layout) is not None:
        return None
    shard_model(teacher, compute_dtype=compute, offload=offload, device=torch.device(rank.device))
    materialize(teacher, where)
    load_local_shards(teacher, layout)
    return teacher.eval().requires_grad_(False)


def _lora_policy(rank: Any, model_path: str, dtype: torch.dtype) -> ShardedActor:
    from weir.train.lora import apply_lora
    from weir.train.model import load_model
    from weir.train.sharded_lora import ShardedLoraActor

    settings = rank.settings
    baseline = reset_peak_rss()
    model = load_model(model_path, dtype, rank.device)[0]
    peft_model = apply_lora(model, settings.lora, base_path=model_path, seed=settings.seed)
    compute = Precision.from_config(settings.train, device=rank.device).compute_dtype
    shard_model(
        peft_model,
        compute_dtype=compute,
        offload=settings.train.offload_optimizer,
        device=torch.device(rank.device),
    )
    actor = ShardedLoraActor(peft_model, settings.actor)
    rank.start.update(meta=0.0, sharded=1.0, peak_rss_mb=peak_rss_since(baseline) / 2**20)
    return actor


def build_critic(rank: Any, policy_path: str, dtype: torch.dtype) -> Any:
    """The rank's sharded critic (`critic.model_path`, else a copy of the policy's initial model):
    the backbone of a causal LM loaded whole, a zero value head, sharded with FSDP2."""
    from weir.train.critic import value_model_from
    from weir.train.model import load_model
    from weir.train.sharded_critic import ShardedCritic

    settings = rank.settings
    path = settings.critic_path or policy_path
    lm, _ = load_model(path, dtype, rank.device)
    if settings.critic_path is not None:
        from transformers import AutoConfig

        ours = AutoConfig.from_pretrained(policy_path).vocab_size
        if lm.config.vocab_size != ours:
            raise ValueError(
                f"critic.model_path has a vocabulary of {lm.config.vocab_size} tokens, the policy "
                f"{ours}: the critic must use the policy's tokenizer (or leave critic.model_path "
                "unset)"
            )
    return ShardedCritic(value_model_from(lm, share=True), settings.critic)


def rank_modules(policies: dict[str, Any], critics: dict[str, Any]) -> list[torch.nn.Module]:
    """Every module a rank holds weights of (policies, their references, critics): what an
    offload moves."""
    out: list[torch.nn.Module] = []
    for a in policies.values():
        out.append(a.model)
        if isinstance(a.ref, torch.nn.Module):  # LoRA's reference is the model, adapters off
            out.append(a.ref)
    out += [c.model for c in critics.values()]
    return out
