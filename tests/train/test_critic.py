"""The critic: value alignment, split-invariant updates, warm-up, shared backbone, state round trip."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.critic import (
    Critic,
    CriticSettings,
    explained,
    response_values,
    value_model_from,
)
from weir.train.optim import OffloadedAdamW


def _cfg(*overrides: str):
    return build_config(
        {},
        [
            "rollout.batch_prompts=2",
            "rollout.n=4",
            "train.lr=1e-3",
            "algo.advantage=gae",
            "critic.lr=1e-3",
            *overrides,
        ],
    )


def _critic(model_dir, *overrides: str, lm=None) -> Critic:
    cfg = _cfg(*overrides)
    lm = lm if lm is not None else AutoModelForCausalLM.from_pretrained(model_dir)
    settings = CriticSettings.from_config(cfg)
    return Critic(value_model_from(lm, share=cfg.critic.shared_backbone), settings)


def _random_head(critic: Critic, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = critic.model.head.weight
        w.copy_(0.1 * torch.randn(w.shape, generator=g))
        critic.model.head.bias.fill_(0.3)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_values_are_those_of_the_state_before_each_response_token(tiny_model_dir, layout):
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    critic = _critic(tiny_model_dir, lm=lm)
    _random_head(critic)
    seqs = [[5, 9, 11, 40, 41, 42], [7, 8, 50], [3, 4, 5, 6, 60, 61, 62, 63]]
    lens = [3, 1, 4]
    got = response_values(critic.model, seqs, lens, layout=layout, pad_to=6)
    assert got.shape == (3, 6)
    w, b = critic.model.head.weight[0], critic.model.head.bias[0]
    with torch.no_grad():
        for i, (seq, n) in enumerate(zip(seqs, lens, strict=True)):
            # one sequence at a time through the policy's own (unshared) backbone
            h = lm.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
            p = len(seq) - n
            want = torch.stack([h[p - 1 + j] @ w + b for j in range(n)])
            assert torch.allclose(got[i, :n], want, atol=1e-5), (i, got[i], want)
            assert torch.all(got[i, n:] == 0)


def test_update_does_not_depend_on_micro_batch_size_and_fits_the_returns(tiny_model_dir):
    batch = make_batch(toy_groups(), version=0)
    mask = batch.response_mask.bool()
    returns = batch.rewards[:, None].expand_as(mask) * mask
    grads, losses = [], []
    # one micro-batch, many, and one with activation checkpointing: the same gradient
    for opts in (
        ("train.micro_batch_tokens=10000",),
        ("train.micro_batch_tokens=20",),
        ("train.gradient_checkpointing=true",),
    ):
        critic = _critic(tiny_model_dir, *opts, "critic.grad_clip=null")
        _random_head(critic)
        old, m, _ = critic.values(batch, batch.response_mask)
        stats = critic.train(batch, old, returns, m)
        losses.append(stats["critic/value_loss"])
        grads.append(torch.cat([p.grad.flatten() for p in critic.model.parameters()]))
    assert grads[0].abs().max() > 1e-3
    for g, loss in zip(grads[1:], losses[1:], strict=True):
        assert torch.allclose(grads[0], g, rtol=1e-4, atol=1e-6)
        assert losses[0] == pytest.approx(loss, rel=1e-5)

    first = None
    for _ in range(10):  # the same batch again and again: the values approach the returns
        old, m, _ = critic.values(batch, batch.response_mask)
        stats = critic.train(batch, old, returns, m)
        first = first if first is not None else stats["critic/value_error"]
    assert stats["critic/value_error"] < 0.4 * first, (first, stats)
    values, m, _ = critic.values(batch, batch.response_mask)
    assert explained(values, returns, m)["critic/explained_variance"] > 0.1


def test_shared_backbone_is_the_policys_and_only_the_head_is_the_critics_own(tiny_model_dir):
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    critic = _critic(tiny_model_dir, "critic.shared_backbone=true", lm=lm)
    assert critic.model.backbone is lm.model
    assert set(critic.weights()) == {"head.weight", "head.bias"}
    before = lm.model.embed_tokens.weight.detach().clone()
    batch = make_batch(toy_groups(), version=0)
    _random_head(critic)
    old, m, _ = critic.values(batch, batch.response_mask)
    critic.train(batch, old, batch.rewards[:, None] * m, m)
    assert not torch.equal(lm.model.embed_tokens.weight, before)  # the critic moved the policy


def test_critic_warm_up_freezes_the_policy_and_gae_uses_the_values(tiny_model_dir):
    cfg = _cfg("critic.freeze_actor_steps=2", "algo.advantage_options={whiten: false}")
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    actor = Actor(lm, ActorSettings.from_config(cfg))
    critic = Critic(value_model_from(lm, share=False), CriticSettings.from_config(cfg))
    batch = make_batch(toy_groups(), version=0)
    policy = [p.detach().clone() for p in actor.model.parameters()]
    stats = actor.train(batch, critic=critic)
    # a zero-initialised head: V = 0, so with gamma = lam = 1 every token's return is its reward
    m = batch.response_mask
    want = (batch.rewards[:, None] * m).sum() / m.sum()
    assert stats["critic/returns_mean"] == pytest.approx(want.item())
    assert stats["critic/values_mean"] == 0.0
    assert stats["critic/actor_frozen"] == 1.0 and "policy/pg_loss" not in stats
    stats = actor.train(batch, critic=critic)
    assert stats["critic/actor_frozen"] == 1.0
    assert stats["critic/values_mean"] != 0.0  # the critic has learnt
    assert all(torch.equal(a, b) for a, b in zip(policy, actor.model.parameters(), strict=True))
    stats = actor.train(batch, critic=critic)
    assert stats["critic/actor_frozen"] == 0.0 and "policy/pg_loss" in stats
    assert not all(torch.equal(a, b) for a, b in zip(policy, actor.model.parameters(), strict=True))


@pytest.mark.parametrize(("shared", "offload"), [(False, False), (True, False), (False, True)])
def test_state_round_trips_and_training_continues_exactly(
    tiny_model_dir, tmp_path, shared, offload
):
    opt = f"critic.shared_backbone={str(shared).lower()}"
    off = f"train.offload_optimizer={str(offload).lower()}"
    batch = make_batch(toy_groups(), version=0)
    returns = batch.rewards[:, None] * batch.response_mask

    def step(c: Critic) -> dict[str, float]:
        old, m, _ = c.values(batch, batch.response_mask)
        return c.train(batch, old, returns, m)

    a = _critic(tiny_model_dir, opt, off, "critic.schedule=cosine", "critic.warmup_steps=1")
    for _ in range(2):
        step(a)
    a.save(tmp_path / "critic")
    lm_b = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    if shared:  # the policy's checkpoint carries the shared backbone
        lm_b.model.load_state_dict(a.model.backbone.state_dict())
    b = _critic(
        tiny_model_dir, opt, off, "critic.schedule=cosine", "critic.warmup_steps=1", lm=lm_b
    )
    assert isinstance(b.optimizer, OffloadedAdamW) == offload
    b.load(tmp_path / "critic")
    assert (b.steps, b.updates) == (a.steps, a.updates) == (2, 2)
    for (ka, va), (kb, vb) in zip(
        a.model.state_dict().items(), b.model.state_dict().items(), strict=True
    ):
        assert ka == kb and torch.equal(va, vb), ka
    sa, sb = step(a), step(b)
    sa.pop("time/critic"), sb.pop("time/critic")
    assert sa == sb
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_missing_critic_state_is_a_one_line_error(tiny_model_dir, tmp_path):
    critic = _critic(tiny_model_dir)
    with pytest.raises(ValueError, match="no critic state"):
        critic.load(tmp_path / "step_1" / "critic")


def test_a_critic_model_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from weir.train.critic import load_value_model

    small = Qwen3Config(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    Qwen3ForCausalLM(small).save_pretrained(tmp_path / "other")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "other")
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    settings = CriticSettings.from_config(_cfg(f"critic.model_path={tmp_path / 'other'}"))
    with pytest.raises(ValueError, match="vocabulary of 50 tokens"):
        load_value_model(settings, policy, tmp_path)
    same = CriticSettings.from_config(_cfg(f"critic.model_path={tiny_model_dir}"))
    value_model = load_value_model(same, policy, tmp_path)
    assert value_model.backbone is not policy.model
    assert value_model.head.weight.abs().sum() == 0


def test_non_finite_values_drop_their_sample_and_a_non_finite_forward_skips_the_update(
    tiny_model_dir,
):
    cfg = _cfg()
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    actor = Actor(lm, ActorSettings.from_config(cfg))
    critic = Critic(value_model_from(lm, share=False), CriticSettings.from_config(cfg))
    batch = make_batch(toy_groups(), version=0)
    forward = critic._forward

    def nan_in_sample_0(b, idx, width):
        v = forward(b, idx, width)
        return torch.where(torch.tensor(idx)[:, None] == 0, float("nan"), v)

    critic._forward = nan_in_sample_0
    values, mask, stats = critic.values(batch, batch.response_mask)
    assert stats["critic/nonfinite_value_samples"] == 1.0
    assert mask[0].sum() == 0 and mask[1:].equal(batch.response_mask[1:])
    assert torch.isfinite(values).all()

    stats = actor.train(batch, critic=critic)  # sample 0 is left out of GAE and both updates
    assert stats["critic/nonfinite_value_samples"] == 1.0
    assert stats["critic/skipped_updates"] == 0.0 and math.isfinite(stats["critic/value_loss"])
    assert math.isfinite(stats["train/loss"])

    def all_nan(b, idx, width):
        return forward(b, idx, width) * float("nan")

    critic._forward = all_nan  # an overflow inside the critic's update: skipped and counted
    before = [p.detach().clone() for p in critic.model.parameters()]
    stats = critic.train(batch, values, values, mask)
    assert stats["critic/skipped_updates"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, critic.model.parameters(), strict=True))


def test_a_sharded_critic_trains_its_float32_shards_when_a_compute_copy_is_asked_for(
    tiny_model_dir,
):
    """On CUDA `train.mixed_precision: auto` asks for a compute copy. An FSDP2 critic (every critic
    on Ray) must not take one: FSDP2 casts its own shards, and a copy swapped in before its first
    forward would become the parameter it gathers. Forced here on a CPU (bf16 compute, one gloo
    rank): the critic computes under autocast over FSDP2, its float32 shards move and the value
    error falls."""
    import torch.distributed as dist

    from weir.train.distributed import free_port
    from weir.train.sharded_critic import ShardedCritic

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        cfg = _cfg("train.compute_dtype=bfloat16", "train.mixed_precision=compute_copy")
        lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        critic = ShardedCritic(value_model_from(lm, share=False), CriticSettings.from_config(cfg))
        assert critic._copy is None
        head = critic.model.head.weight
        assert head.dtype == torch.float32
        before = head.full_tensor().clone()
        batch = make_batch(toy_groups(), version=0)
        mask = batch.response_mask.bool()
        returns = batch.rewards[:, None].expand_as(mask) * mask
        errors = []
        for _ in range(8):
            old, m, _ = critic.values(batch, batch.response_mask)
            errors.append(critic.train(batch, old, returns, m)["critic/value_error"])
        assert not torch.equal(head.full_tensor(), before)
        assert errors[-1] < 0.7 * errors[0], errors
    finally:
        dist.destroy_process_group()
