"""`train.mixed_precision: compute_copy`: one process computes on a bfloat16 copy of its float32
masters as an FSDP2 rank does (bf16 compute on a CPU, as the tests may)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.compute_copy import ComputeCopy
from weir.train.distributed import free_port

BF16 = ["train.compute_dtype=bfloat16"]


def _cfg(*extra: str):
    return build_config({}, ["rollout.batch_prompts=2", "rollout.n=4", *BF16, *extra])


@pytest.fixture
def one_rank_group():
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize(
    "extra",
    [
        ("train.packing=varlen", "algo.entropy_coef=0.01"),
        ("train.packing=padded", "train.gradient_checkpointing=true", "algo.kl.coef=0.1"),
    ],
    ids=["varlen-entropy", "checkpointed-kl"],
)
def test_a_compute_copy_step_is_an_fsdp2_rank_step(tiny_model_dir, one_rank_group, extra):
    """Two AdamW steps at lr 1e-3 (the second on updated weights, the reference frozen at the
    first): the one-process compute copy and a one-rank FSDP2 step give the same losses,
    gradients and weights (bit for bit when measured here; asserted within 1e-6), while autocast
    differs from both by about 1e-3 in the gradients."""
    from weir.train.sharded_actor import ShardedActor

    batch = make_batch(toy_groups(), version=0)
    runs = {}
    for name, cls, mode in (
        ("fsdp", ShardedActor, "autocast"),  # FSDP2 ranks cast the shards whatever the mode
        ("copy", Actor, "compute_copy"),
        ("autocast", Actor, "autocast"),
    ):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        cfg = _cfg("train.lr=1e-3", f"train.mixed_precision={mode}", *extra)
        actor = cls(model, ActorSettings.from_config(cfg))
        losses = [actor.train(batch)["train/loss"] for _ in range(2)]
        params = list(actor.model.parameters())
        runs[name] = (
            torch.tensor(losses),
            torch.cat([_full(p.grad).flatten() for p in params]),
            torch.cat([_full(p.detach()).flatten() for p in params]),
        )
    for got, want in zip(runs["copy"], runs["fsdp"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert (runs["autocast"][1] - runs["fsdp"][1]).abs().max() > 1e-4


def test_gradients_land_in_the_float32_masters_and_the_sync_reads_them(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    masters = dict(model.named_parameters())
    cfg = _cfg("train.lr=1e-6", "train.grad_clip=null", "train.mixed_precision=compute_copy")
    actor = Actor(model, ActorSettings.from_config(cfg))
    seen: list[tuple[torch.dtype, torch.dtype, bool]] = []

    def look(mod, args):
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        seen.append((mod.weight.dtype, args[0].dtype, tied))

    model.model.layers[0].mlp.down_proj.register_forward_pre_hook(look)
    before = {n: p.detach().clone() for n, p in masters.items()}
    stats = actor.train(make_batch(toy_groups(), version=0))
    assert stats["train/grad_norm"] > 0
    # in the step: bf16 weights and activations, the tied head still one tensor
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16, True)}
    # after it: the very same float32 parameters, with float32 gradients, that AdamW stepped
    assert dict(model.named_parameters()) == masters
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in masters.values())
    stepped = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    assert stepped == {id(p) for p in masters.values()}
    moved = total = 0
    for n, p in masters.items():
        has = p.grad.ne(0)
        moved += int((p.detach().ne(before[n]) & has).sum())
        total += int(has.sum())
    assert moved / total > 0.95  # lr 1e-6 lands on float32 masters (bf16 would lose most)
    # what the engine sync and a checkpoint read: the masters themselves
    assert all(w is masters[n] for n, w in actor.weights())
    assert all(
        t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point()
    )
    seen.clear()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert seen[0][0] == torch.float32  # a forward outside the step runs the masters


def test_the_copy_is_made_afresh_so_weights_loaded_between_steps_count(tiny_model_dir):
    """The copy is cast at each activation: a checkpoint loaded into the masters between steps
    (here: zeroed MLP weights) is what the next forward computes with."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    copy = ComputeCopy(model, torch.bfloat16)
    down = model.model.layers[0].mlp.down_proj
    with copy.active():
        assert down.weight.dtype == torch.bfloat16
        assert torch.equal(down.weight.float(), model.model.layers[0].mlp.down_proj.weight.float())
    with torch.no_grad():
        down.weight.zero_()
    with copy.active():
        assert down.weight.dtype == torch.bfloat16 and not down.weight.any()
    assert down.weight.dtype == torch.float32


def test_lora_trains_its_adapters_on_the_copy_and_the_reference_is_the_base(tiny_model_dir):
    pytest.importorskip("peft")
    from weir.train.lora import LoraActor, apply_lora

    cfg = _cfg(
        "train.lr=1e-2",
        "train.mixed_precision=compute_copy",
        "lora.enabled=true",
        "lora.target_modules=[q_proj,v_proj,down_proj]",
        "algo.kl.coef=0.1",
    )
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), cfg.lora)
    actor = LoraActor(model, ActorSettings.from_config(cfg))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    batch = make_batch(toy_groups(), version=0)
    m = batch.response_mask.bool()
    # B = 0: the policy is the base model, through the same bf16 copy
    assert torch.equal(actor.logprobs(actor.ref, batch)[m], actor.logprobs(actor.model, batch)[m])
    stats = actor.train(batch)
    assert stats["train/grad_norm"] > 0
    now = dict(model.named_parameters())
    assert all(now[n].dtype == torch.float32 for n in now)
    assert all(torch.equal(now[n], p) for n, p in frozen.items())
    assert all(not torch.equal(now[n], p) for n, p in adapters.items() if "lora_B" in n)
    assert all(now[n].grad.dtype == torch.float32 for n in adapters)
    ref, policy = actor.logprobs(actor.ref, batch), actor.logprobs(actor.model, batch)
    assert (ref[m] - policy[m]).abs().max() > 1e-3  # the reference stayed the base model


def test_the_critic_computes_on_its_own_copy_beside_a_shared_backbone(tiny_model_dir):
    from weir.train.critic import Critic, CriticSettings, value_model_from

    cfg = _cfg(
        "train.lr=1e-3",
        "train.mixed_precision=compute_copy",
        "algo.advantage=gae",
        "critic.lr=1e-3",
        "critic.shared_backbone=true",
    )
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    actor = Actor(lm, ActorSettings.from_config(cfg))
    critic = Critic(value_model_from(lm, share=True), CriticSettings.from_config(cfg))
    masters = dict(lm.named_parameters())
    head = critic.model.head.weight
    seen = []
    critic.model.head.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.dtype))
    batch = make_batch(toy_groups(), version=0)
    for _ in range(2):
        stats = actor.train(batch, critic=critic)
    assert stats["critic/values_mean"] != 0.0 and "policy/pg_loss" in stats
    assert seen and set(seen) == {torch.bfloat16}
    assert dict(lm.named_parameters()) == masters and critic.model.head.weight is head
    assert head.dtype == torch.float32 and head.grad.dtype == torch.float32
    values, _, _ = critic.values(batch, batch.response_mask)
    assert values.dtype == torch.float32 and torch.isfinite(values).all()
