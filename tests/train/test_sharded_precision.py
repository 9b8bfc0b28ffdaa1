"""FSDP2 mixed precision (the Ray trainer's path) in one process: a gloo group of one rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from weir.config import build_config
from weir.train.actor import ActorSettings
from weir.train.batch import make_batch
from weir.train.distributed import ShardedActor, free_port


@pytest.fixture
def one_rank_group():
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_computes_in_bfloat16_on_float32_shards(tiny_model_dir, one_rank_group):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = build_config(
        {},
        ["rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-6", "train.compute_dtype=bfloat16"],
    )
    actor = ShardedActor(model, ActorSettings.from_config(cfg))
    assert not actor.precision.mixed  # no autocast on top of FSDP2's own casts
    seen = []
    layer = model.model.layers[0].mlp.down_proj
    layer.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.dtype))
    before = [p.detach().to_local().clone() for p in model.parameters()]
    stats = actor.train(make_batch(toy_groups(), version=0))
    assert seen and set(seen) == {torch.bfloat16}  # the gathered weights are cast for compute
    assert stats["train/grad_norm"] > 0
    moved = total = 0
    for b, p in zip(before, model.parameters(), strict=True):
        local = p.detach().to_local()
        assert local.dtype == torch.float32  # master shards stay float32
        grad = p.grad.to_local()
        assert grad.dtype == torch.float32
        has = grad.ne(0)
        moved += int((local.ne(b) & has).sum())
        total += int(has.sum())
    assert moved / total > 0.95  # lr 1e-6 updates land on the float32 shards
    state = next(iter(actor.optimizer.state.values()))
    assert state["exp_avg"].to_local().dtype == torch.float32


def test_an_asked_for_prefix_layout_is_refused_when_the_rank_starts(tiny_model_dir, one_rank_group):
    """What can be refused without running the model is refused up front, not at the first step
    (the probe itself runs at the first forward, with every rank)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = build_config(
        {},
        ["rollout.batch_prompts=2", "train.packing=prefix", "train.gradient_checkpointing=true"],
    )
    with pytest.raises(ValueError, match="train.packing=prefix: .*gradient checkpointing"):
        ShardedActor(model, ActorSettings.from_config(cfg))


def test_auto_resolves_to_prefix_at_the_first_step_in_the_compute_dtype(
    tiny_model_dir, one_rank_group
):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = build_config(
        {}, ["rollout.batch_prompts=2", "rollout.n=4", "train.compute_dtype=bfloat16"]
    )
    actor = ShardedActor(model, ActorSettings.from_config(cfg))
    assert actor._layout is None
    actor.train(make_batch(toy_groups(), version=0))
    assert actor.layout == "prefix"
