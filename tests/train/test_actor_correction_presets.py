"""`algo.correction.preset` reaches the actor's step, and every step reports the ratios' spread."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from weir.algo import RECOMMENDABLE
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch


def _actor(model_dir, *opts: str) -> Actor:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = build_config({}, ["rollout.batch_prompts=2", "rollout.n=4", "train.lr=1e-3", *opts])
    return Actor(model, ActorSettings.from_config(cfg))


def test_icepop_preset_removes_the_tokens_outside_its_band(tiny_model_dir):
    actor = _actor(tiny_model_dir, "algo.correction.preset=icepop")
    assert actor.correction["mode"] == "token_mis" and actor.correction["high"] == 5.0
    batch = make_batch(toy_groups(), version=0)
    trainer = actor.logprobs(actor.model, batch)
    # sample 0's engine log-probs are log(10) above the trainer's: ratio 0.1, outside [0.5, 5]
    shift = torch.zeros(len(batch), 1)
    shift[0] = math.log(10.0)
    batch.rollout_logprobs = (trainer + shift) * batch.response_mask
    stats = actor.train(batch)
    tokens = batch.response_mask.sum(1)
    assert stats["correction/masked_frac"] == pytest.approx(float(tokens[0] / tokens.sum()))
    assert stats["mismatch/outside/icepop"] == pytest.approx(float(tokens[0] / tokens.sum()))
    assert RECOMMENDABLE[int(stats["mismatch/recommended"])] == "icepop"


def test_a_fused_step_reports_the_spread(tiny_model_dir):
    """The default step (old log-probs from the update's own forward) measures the ratios there."""
    actor = _actor(tiny_model_dir, "train.dead_rows=forward")
    assert actor._fused_old
    batch = make_batch(toy_groups(), version=0)
    batch.rollout_logprobs = actor.logprobs(actor.model, batch) * batch.response_mask
    stats = actor.train(batch)
    assert stats["mismatch/max_abs_logratio"] < 1e-4
    assert stats["mismatch/token_ratio_q01"] == pytest.approx(1.0, abs=1e-4)
    assert RECOMMENDABLE[int(stats["mismatch/recommended"])] == "none"
