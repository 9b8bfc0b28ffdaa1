from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from weir.config import build_config
from weir.config.schema import SFTConfig
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.sft import sft


def _actor(model_dir, **overrides) -> Actor:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opts = [f"{k}={v}" for k, v in overrides.items()]
    cfg = build_config({}, ["rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-3", *opts])
    return Actor(model, ActorSettings.from_config(cfg))


def _seq_logp(actor: Actor, batch) -> torch.Tensor:
    return (actor.logprobs(actor.model, batch) * batch.response_mask).sum(1)


def test_policy_step_raises_rewarded_and_lowers_unrewarded(tiny_model_dir):
    actor = _actor(tiny_model_dir)
    batch = make_batch(toy_groups(), version=0)
    batch.rollout_logprobs = actor.logprobs(actor.model, batch)  # on-policy behaviour log-probs
    before = _seq_logp(actor, batch)
    first = actor.train(batch)
    assert first["mismatch/abs_logp_diff"] < 1e-5 and first["train/grad_norm"] > 0
    for _ in range(2):
        actor.train(batch)
    after = _seq_logp(actor, batch)
    good = batch.rewards > 0
    assert torch.all(after[good] > before[good])
    assert torch.all(after[~good] < before[~good])


def test_gradient_does_not_depend_on_micro_batch_size(tiny_model_dir):
    """Packing into 1 or many micro-batches gives the same update (global-count aggregation)."""
    results, pg_losses = [], []
    for budget in (10_000, 20):
        actor = _actor(
            tiny_model_dir, **{"train.micro_batch_tokens": budget, "train.grad_clip": "null"}
        )
        batch = make_batch(toy_groups(), version=0)
        batch.rollout_logprobs = actor.logprobs(actor.model, batch) - 0.05  # ratios != 1
        stats = actor.train(batch)
        pg_losses.append(stats["policy/pg_loss"])
        results.append(torch.cat([p.grad.flatten() for p in actor.model.parameters()]))
    assert results[0].abs().max() > 1e-3
    assert torch.allclose(results[0], results[1], atol=1e-6)
    assert pg_losses[0] == pytest.approx(
        pg_losses[1], abs=1e-6
    )  # reported loss: same split-invariance


def test_sft_lowers_loss_on_a_fixed_batch(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    examples = [([3, 22, 23, 16, 24, 25, 1, 4], [26, 24, 1])] * 8
    losses = sft(
        model,
        examples,
        SFTConfig(epochs=20, batch_size=8, lr=1e-3, warmup_steps=0, schedule="constant"),
    )
    assert losses[-1] < 0.5 * losses[0]


def test_a_batch_with_nothing_trainable_is_none():
    groups = toy_groups()
    for g in groups:
        for s in g.samples:
            s.reward = None
    assert make_batch(groups, version=0) is None


def test_failed_and_empty_samples_are_dropped_and_counted():
    groups = toy_groups()
    groups[0].samples[0].reward = None
    groups[1].samples[1].response_ids, groups[1].samples[1].loss_mask = [], []
    groups[1].samples[1].rollout_logprobs, groups[1].samples[1].versions = [], []
    batch = make_batch(groups, version=2)
    assert len(batch) == 6 and batch.metrics["batch/dropped_samples"] == 2
    assert batch.metrics["staleness/mean"] == 2.0  # every token was produced by version 0


VARIANTS = {
    "kl_loss": {"algo.kl.coef": 0.1},
    "kl_reward_adaptive": {
        "algo.kl.coef": 0.1,
        "algo.kl.as_reward": "true",
        "algo.kl.adaptive_target": 0.01,
        "algo.advantage": "reinforce_pp",
    },
    "token_tis": {"algo.correction.mode": "token_tis"},
    "seq_mask": {
        "algo.correction.mode": "seq_mask",
        "algo.correction.low": 0.1,
        "algo.correction.high": 10,
    },
    "decoupled_ppo": {
        "algo.policy_loss": "decoupled_ppo",
        "algo.loss_options": "{eps_low: 0.2, eps_high: 0.2, tis_cap: 2.0}",
    },
    "gspo_seq_mean": {
        "algo.policy_loss": "gspo",
        "algo.loss_options": "{}",
        "algo.loss_agg": "seq-mean-token-mean",
    },
    "cispo": {"algo.policy_loss": "cispo", "algo.loss_options": "{}"},
    "reinforce_rloo": {
        "algo.policy_loss": "reinforce",
        "algo.loss_options": "{}",
        "algo.advantage": "rloo",
    },
    "dr_grpo_norm": {
        "algo.advantage_options": "{norm_by_std: false}",
        "algo.loss_agg": "seq-mean-token-sum-norm",
    },
    "minibatches_epochs_cosine": {
        "train.mini_batches": 2,
        "train.epochs": 2,
        "train.schedule": "cosine",
        "train.warmup_steps": 1,
    },
    "engine_logprobs_entropy": {"algo.old_logprobs": "engine", "algo.entropy_coef": 0.01},
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_algorithm_variant_trains(tiny_model_dir, name):
    actor = _actor(tiny_model_dir, **VARIANTS[name])
    batch = make_batch(toy_groups(), version=0)
    batch.rollout_logprobs = (
        actor.logprobs(actor.model, batch) + 0.01
    )  # a small engine/trainer mismatch
    before = [p.detach().clone() for p in actor.model.parameters()]
    stats = actor.train(batch)
    assert all(math.isfinite(v) for v in stats.values()), stats
    assert stats["train/grad_norm"] > 0 and stats["train/skipped_updates"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, actor.model.parameters(), strict=True))
    if "algo.kl.coef" in VARIANTS[name]:
        assert "kl/ref" in stats
    if VARIANTS[name].get("algo.correction.mode"):
        assert any(k.startswith("correction/") for k in stats)
    if actor.needs_recompute:
        assert stats["mismatch/abs_logp_diff"] == pytest.approx(0.01, abs=1e-4)


def test_a_mini_batch_emptied_by_masking_is_skipped(tiny_model_dir):
    actor = _actor(tiny_model_dir, **{"algo.correction.mode": "seq_mask", "train.mini_batches": 8})
    batch = make_batch(toy_groups(), version=0)
    batch.rollout_logprobs = actor.logprobs(actor.model, batch)
    batch.rollout_logprobs[3] += 5.0  # sample 3 is rejected by sequence masking
    stats = actor.train(batch)  # used to raise: num_tokens == 0 for the mini-batch of sample 3
    assert stats["correction/masked_seq_frac"] == pytest.approx(1 / 8)
    assert math.isfinite(stats["train/loss"]) and stats["train/skipped_updates"] == 0


def test_misspelt_options_fail_at_start_up(tiny_model_dir):
    with pytest.raises(ValueError, match="eps_hgh"):
        _actor(tiny_model_dir, **{"algo.loss_options": "{eps_hgh: 0.3}"})
    gae = _actor(tiny_model_dir, **{"algo.advantage": "gae"})  # PPO with a critic: it is given
    with pytest.raises(ValueError, match="needs a critic"):  # to train(), not the constructor
        gae.train(make_batch(toy_groups(), version=0))
