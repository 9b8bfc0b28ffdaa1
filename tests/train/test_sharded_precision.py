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
from weir.train.distributed import free_port
from weir.train.sharded_actor import ShardedActor


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
    assert actor._layouts is None
    actor.train(make_batch(toy_groups(), version=0))
    assert "prefix" in actor.layouts.candidates


def test_compute_device_is_where_fsdp_gathers_not_where_shards_rest(tiny_model_dir, one_rank_group):
    """Inputs and targets go where the forward computes. With CPU offload on a GPU the shards rest
    on the host, so the parameters' device is the wrong answer (a GPU run failed on exactly this)."""
    from weir.train.precision import compute_device
    from weir.train.sharded_actor import shard_model

    model = shard_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert compute_device(model) == model._get_fsdp_state()._device == torch.device("cpu")

    class Offloaded(torch.nn.Linear):
        def _get_fsdp_state(self):
            return type("State", (), {"_device": torch.device("cuda", 0)})()

    assert compute_device(Offloaded(2, 2)) == torch.device("cuda", 0)
    assert compute_device(torch.nn.Linear(2, 2)) == torch.device("cpu")


def test_a_meta_model_sharded_for_a_gpu_rank_gets_the_cpu_offload_policy(
    tiny_model_dir, monkeypatch
):
    """A rank starting from the meta device has no parameter device to read: it names its own,
    or FSDP2 would keep the host-materialised shards without offloading (gradients then land on
    the GPU beside host parameters, as the first GPU run showed)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from weir.train import sharded_actor
    from weir.train.meta_init import build_on_meta

    seen = []
    monkeypatch.setattr(sharded_actor, "fully_shard", lambda m, **kw: seen.append(kw) or m)
    meta = build_on_meta(str(tiny_model_dir), torch.float32)
    sharded_actor.shard_model(meta, offload=True, device=torch.device("cuda", 0))
    assert seen and all(isinstance(kw["offload_policy"], CPUOffloadPolicy) for kw in seen)
    seen.clear()
    sharded_actor.shard_model(meta, offload=True, device=torch.device("cpu"))
    assert seen and not any(isinstance(kw["offload_policy"], CPUOffloadPolicy) for kw in seen)


def test_the_varlen_layout_on_an_fsdp2_rank_trains_what_one_process_trains(
    tiny_model_dir, one_rank_group
):
    """The varlen forward's kwargs pass through FSDP2's hooks: a sharded rank's gradient equals
    the one-process varlen step's, and the padded step's."""
    from weir.train.actor import Actor

    batch = make_batch(toy_groups(), version=0)
    grads = {}
    for name, cls, packing in (
        ("sharded", ShardedActor, "varlen"),
        ("one", Actor, "varlen"),
        ("padded", Actor, "padded"),
    ):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        opts = ["rollout.batch_prompts=2", "rollout.n=4", f"train.packing={packing}"]
        actor = cls(model, ActorSettings.from_config(build_config({}, opts)))
        actor.train(batch)
        assert actor.layout == packing
        grads[name] = torch.cat(
            [
                (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten()
                for p in actor.model.parameters()
            ]
        )
    assert torch.allclose(grads["sharded"], grads["one"], atol=1e-6, rtol=1e-4)
    assert torch.allclose(grads["one"], grads["padded"], atol=1e-5, rtol=1e-3)
