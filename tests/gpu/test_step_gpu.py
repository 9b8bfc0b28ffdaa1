"""The issue-17 trainer step on CUDA: the prefix layout (SDPA, no FlashAttention-2) and the fused
old log-probs give the padded two-pass step's log-probs and gradients, in float32 and under bf16
autocast."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.toy import toy_groups
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.packing import choose_layout, response_logprobs

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)


def test_prefix_layout_equals_padded_on_cuda(tiny_model_dir):
    torch.backends.cuda.matmul.allow_tf32 = False  # exact float32: the layouts, not TF32, compared
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA).eval()
    assert choose_layout(model, "auto", shared_prompts=True) == "prefix"
    batch = make_batch(toy_groups(), version=0)
    out = {}
    for layout in ("prefix", "padded"):
        model.zero_grad(set_to_none=True)
        res = response_logprobs(
            model, batch.sequences, batch.response_lengths, layout=layout, with_entropy=True
        )
        res.logprobs.sum().backward()
        out[layout] = (
            res.logprobs.detach(),
            torch.cat([p.grad.flatten() for p in model.parameters()]),
        )
    assert torch.allclose(out["prefix"][0], out["padded"][0], atol=1e-4)
    assert torch.allclose(out["prefix"][1], out["padded"][1], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_the_new_step_trains_as_the_padded_two_pass_step_on_cuda(tiny_model_dir, compute):
    grads = []
    for new in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA)
        packing = "auto" if new else "padded"
        cfg = build_config(
            {},
            [
                "rollout.batch_prompts=2",
                "rollout.n=4",
                f"train.packing={packing}",
                f"train.compute_dtype={compute}",
            ],
        )
        actor = Actor(model, ActorSettings.from_config(cfg))
        actor.fuses_old_logprobs = actor.skips_dead_backward = new
        assert actor.layout == ("prefix" if new else "padded")
        actor.train(make_batch(toy_groups(), version=0))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    tol = 1e-4 if compute == "float32" else 3e-2
    assert torch.allclose(grads[0], grads[1], atol=tol, rtol=tol)


def test_the_local_trainer_steps_with_fused_adamw_as_foreach_does(tiny_model_dir):
    """CUDA float parameters: AdamW runs fused; three steps land where foreach's do (float32,
    TF32 off: the two kernels differ only in rounding)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    weights = []
    for fused in (True, False):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA)
        cfg = build_config(
            {},
            [
                "rollout.batch_prompts=2",
                "rollout.n=4",
                "train.compute_dtype=float32",
                "train.lr=1e-3",
            ],
        )
        actor = Actor(model, ActorSettings.from_config(cfg))
        assert actor.optimizer.defaults["fused"] is True
        if not fused:
            actor.optimizer.defaults["fused"] = None
            for group in actor.optimizer.param_groups:
                group["fused"], group["foreach"] = None, True
        for _ in range(3):
            actor.train(make_batch(toy_groups(), version=0))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert (weights[0] - weights[1]).abs().max() < 1e-5
