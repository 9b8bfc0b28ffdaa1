"""Regression tests for issue 16's bugs found from outside: mismatch coverage, the Dr.GRPO
normaliser in multi-turn runs, and non-finite log-probs contained instead of stopping the run."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch


def _actor(model_dir, *opts: str) -> Actor:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = build_config({}, ["rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-3", *opts])
    return Actor(model, ActorSettings.from_config(cfg))


def _weights(actor: Actor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in actor.model.named_parameters()}


def test_mismatch_covers_every_mini_batch_not_only_the_first(tiny_model_dir):
    """Engine log-probs off by a different constant per sample: the reported mean |diff| is the
    token-weighted mean of those constants over the whole batch."""
    actor = _actor(tiny_model_dir, "algo.old_logprobs=engine", "train.mini_batches=4")
    batch = make_batch(toy_groups(), version=0)
    offsets = torch.arange(1, len(batch) + 1, dtype=torch.float32) * 0.01
    trainer = actor.logprobs(actor.model, batch)
    batch.rollout_logprobs = (trainer + offsets[:, None]) * batch.response_mask
    tokens = batch.response_mask.sum(1)
    expected = float((offsets * tokens).sum() / tokens.sum())
    stats = actor.train(batch)
    assert stats["mismatch/abs_logp_diff"] == pytest.approx(expected, rel=1e-4)


def _pg_loss_one_update(actor: Actor, batch) -> float:
    batch.rollout_logprobs = actor.logprobs(actor.model, batch)  # on policy: ratio 1
    return actor.train(batch)["policy/pg_loss"]


@pytest.mark.parametrize("multi_turn", [False, True])
def test_dr_grpo_normaliser_is_the_longest_possible_response(tiny_model_dir, multi_turn):
    """seq-mean-token-sum-norm: loss = -sum_b sum_t A_b / (S * L), with L = rollout.max_new_tokens
    for one turn and agent.max_tokens (the whole episode's budget) for multi-turn episodes."""
    opts = ["algo.loss_agg=seq-mean-token-sum-norm", "rollout.max_new_tokens=16"]
    if multi_turn:
        opts += ["rollout.function=weir.rollout.multi_turn:rollout", "agent.max_tokens=300"]
    actor = _actor(tiny_model_dir, *opts)
    batch = make_batch(toy_groups(), version=0)
    # GRPO advantages by hand: rewards (1, 1, 0, 0) per group, std (N-1) = 0.57735 -> +-0.866
    a = 0.5 / math.sqrt(1 / 3)
    adv = torch.tensor([a, a, -a, -a, a, a, -a, -a])
    tokens = batch.response_mask.sum(1)
    length = 300 if multi_turn else 16
    expected = float(-(adv * tokens).sum() / (len(batch) * length))
    assert _pg_loss_one_update(actor, batch) == pytest.approx(expected, rel=1e-4)


def test_loss_options_max_len_overrides_and_a_longer_sample_warns(tiny_model_dir):
    actor = _actor(
        tiny_model_dir, "algo.loss_agg=seq-mean-token-sum-norm", "algo.loss_options.max_len=4"
    )
    batch = make_batch(toy_groups(), version=0)  # responses of 3 to 6 tokens
    with pytest.warns(UserWarning, match=r"algo.loss_options.max_len"):
        loss = _pg_loss_one_update(actor, batch)
    a = 0.5 / math.sqrt(1 / 3)
    tokens = batch.response_mask.sum(1)
    adv = torch.tensor([a, a, -a, -a, a, a, -a, -a])
    assert loss == pytest.approx(float(-(adv * tokens).sum() / (len(batch) * 4)), rel=1e-4)


@pytest.mark.parametrize("old", ["engine", "recompute"])
def test_a_nonfinite_engine_logprob_drops_that_sample_and_counts_it(tiny_model_dir, old):
    actor = _actor(tiny_model_dir, f"algo.old_logprobs={old}", "algo.correction.mode=token_tis")
    batch = make_batch(toy_groups(), version=0)
    batch.rollout_logprobs = actor.logprobs(actor.model, batch)
    batch.rollout_logprobs[2, 1] = float("nan")
    before = _weights(actor)
    stats = actor.train(batch)
    assert stats["train/nonfinite_logprob_samples"] == 1.0
    assert math.isfinite(stats["train/loss"]) and math.isfinite(stats["train/grad_norm"])
    assert stats["train/skipped_steps"] == 0.0
    assert any(not torch.equal(before[n], p) for n, p in actor.model.named_parameters())


def test_every_sample_nonfinite_skips_the_step_and_counts_it(tiny_model_dir):
    actor = _actor(tiny_model_dir, "algo.old_logprobs=engine")
    batch = make_batch(toy_groups(), version=0)
    batch.rollout_logprobs = torch.full_like(batch.rollout_logprobs, float("-inf"))
    before = _weights(actor)
    stats = actor.train(batch)
    assert stats["train/skipped_steps"] == 1.0
    assert stats["train/nonfinite_logprob_samples"] == float(len(batch))
    assert all(torch.equal(before[n], p) for n, p in actor.model.named_parameters())
    batch.rollout_logprobs = actor.logprobs(actor.model, batch)
    stats = actor.train(batch)  # the next healthy step trains, and the count stays
    assert stats["train/skipped_steps"] == 1.0 and math.isfinite(stats["train/grad_norm"])


def test_a_nonfinite_trainer_forward_skips_the_update_instead_of_stopping(tiny_model_dir):
    """NaN logits in the gradient forward (an overflow): the update is skipped and counted."""
    actor = _actor(tiny_model_dir, "algo.old_logprobs=engine", "algo.entropy_coef=0.01")
    batch = make_batch(toy_groups(), version=0)
    batch.rollout_logprobs = actor.logprobs(actor.model, batch)
    hook = actor.model.lm_head.register_forward_hook(
        lambda mod, args, out: out * float("nan") if torch.is_grad_enabled() else out
    )
    before = _weights(actor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats = actor.train(batch)
    hook.remove()
    assert stats["train/skipped_updates"] == 1.0
    assert all(torch.equal(before[n], p) for n, p in actor.model.named_parameters())


@pytest.mark.parametrize("choice", ["sampled", "full"])
def test_corrections_weigh_against_the_configured_behaviour_logprobs(tiny_model_dir, choice):
    """Truncated sampling kept mass e^-0.4 of every step: the sampled log-prob is the full one + 0.4,
    so token TIS weights are pi/mu = exp(-0.4) against `sampled` and 1 against `full`."""
    actor = _actor(
        tiny_model_dir, "algo.correction.mode=token_tis", f"algo.behavior_logprobs={choice}"
    )
    batch = make_batch(toy_groups(), version=0)
    batch.rollout_logprobs = actor.logprobs(actor.model, batch)
    batch.behavior_logprobs = (batch.rollout_logprobs + 0.4) * batch.response_mask
    stats = actor.train(batch)
    expected = math.exp(-0.4) if choice == "sampled" else 1.0
    assert stats["correction/ratio_mean"] == pytest.approx(expected, rel=1e-4)
