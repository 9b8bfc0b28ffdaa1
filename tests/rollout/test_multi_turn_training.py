"""The trainer on multi-turn samples: observation tokens (loss_mask 0) are context only."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from weir import algo
from weir.config import build_config
from weir.data.sample import Group, Sample
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch

PROMPT = [3, 30, 23, 15, 27, 1, 4]
# model turn | observation (mask 0) | model turn, for two samples of one prompt
RESPONSES = [
    ([40, 41, 42, 1], [5, 50, 51, 1, 4], [43, 44, 1]),
    ([60, 61, 1], [5, 52, 1, 4], [62, 63, 64, 1]),
]


def _groups() -> list[Group]:
    samples = []
    for i, (a, obs, b) in enumerate(RESPONSES):
        mask = [1] * len(a) + [0] * len(obs) + [1] * len(b)
        samples.append(
            Sample(
                prompt_ids=PROMPT,
                response_ids=a + obs + b,
                loss_mask=mask,
                versions=[0 if m else -1 for m in mask],
                reward=float(i == 0),
                index=i,
            )
        )
    return [Group(samples=samples)]


def _reference_grads(model_dir, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """d/dθ of -(1/N) Σ_b Σ_t m[b,t] A[b,t] logp[b,t], N = Σ m, with plain unpacked forwards.

    At the first update ratios are 1, so PPO's clipped loss has exactly this gradient."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    total = 0.0
    for b, (a, obs, c) in enumerate(RESPONSES):
        resp = a + obs + c
        ids = torch.tensor([PROMPT + resp])
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(resp)[:, None])[:, 0]
        n = len(resp)
        total = total - (mask[b, :n] * advantages[b, :n] * logp).sum()
    (total / mask.sum()).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_masked_observation_tokens_get_no_gradient_and_do_not_count(tiny_model_dir):
    cfg = build_config(
        {},
        [
            "rollout.batch_prompts=1",
            "rollout.n=2",
            "train.grad_clip=null",
            "algo.loss_agg=token-mean",
            "algo.old_logprobs=engine",
        ],
    )
    actor = Actor(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), ActorSettings.from_config(cfg)
    )
    batch = make_batch(_groups(), version=0)
    assert batch.metrics["batch/trained_tokens"] == 4 + 3 + 3 + 4
    # engine log-probs as a rollout records them: the policy's at trained tokens, 0 elsewhere
    batch.rollout_logprobs = actor.logprobs(actor.model, batch) * batch.response_mask
    actor.train(batch)
    got = torch.cat([p.grad.flatten() for p in actor.model.parameters()])

    adv = algo.compute_advantages("grpo", batch.rewards, batch.response_mask, batch.group_ids)
    expected = _reference_grads(tiny_model_dir, adv.advantages, batch.response_mask)
    assert got.abs().max() > 1e-4
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-4)

    # the same reference with observation tokens trained (or counted) differs: the check is sharp
    everything = (
        torch.arange(batch.response_mask.shape[1])[None]
        < torch.tensor([[len(s.response_ids)] for s in batch.samples])
    ).float()
    full_adv = adv.advantages[:, :1].expand_as(everything)
    wrong = _reference_grads(tiny_model_dir, full_adv, everything)
    assert not torch.allclose(got, wrong, atol=1e-6, rtol=1e-3)
