"""The trainer's log-prob kernel (`train.logprob_kernel`): the fused pass gives the reference
functions' step (loss, gradients, entropy metric), with the entropy trained or only logged, in
every layout; `compiled` is refused where it cannot compile."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch


def _step(model_dir, kernel: str, *extra: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = build_config(
        {}, ["rollout.batch_prompts=2", "rollout.n=4", f"train.logprob_kernel={kernel}", *extra]
    )
    actor = Actor(model, ActorSettings.from_config(cfg))
    stats = actor.train(make_batch(toy_groups(), version=0))
    return stats, torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("packing", ["padded", "prefix", "packed"])
@pytest.mark.parametrize("coef", ["0.0", "0.01"])
def test_the_fused_head_trains_as_the_reference(tiny_model_dir, packing, coef):
    extra = (f"train.packing={packing}", f"algo.entropy_coef={coef}")
    fused, g_fused = _step(tiny_model_dir, "eager", *extra)
    ref, g_ref = _step(tiny_model_dir, "reference", *extra)
    for key in ("train/loss", "train/entropy", "train/grad_norm"):
        assert fused[key] == pytest.approx(ref[key], abs=1e-6), key
    torch.testing.assert_close(g_fused, g_ref, atol=1e-6, rtol=1e-5)


def test_compiled_is_refused_where_it_cannot_compile(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = build_config({}, ["train.logprob_kernel=compiled", "train.device=cpu"])
    with pytest.raises(ValueError, match=r"train\.logprob_kernel=compiled on cpu: .*auto"):
        Actor(model, ActorSettings.from_config(cfg))
