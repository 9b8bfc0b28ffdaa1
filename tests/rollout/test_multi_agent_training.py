"""The trainer on multi-agent episodes: each role's view trains only that role's tokens, with that
role's advantages; and two roles of a relay (each computing a part the other needs) learn
together on the CPU."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import weir
from tests.rollout.test_multi_agent import RoleEngine, ctx_for
from weir import algo
from weir.config import build_config
from weir.config.schema import MultiAgentConfig
from weir.data.sample import Group
from weir.rollout.multi_agent import rollout
from weir.tasks.tiny_model import build_tokenizer
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch

TOK = build_tokenizer()
QUICK = str(Path(__file__).parents[2] / "examples" / "relay_quick.yaml")


def _episodes() -> list[Group]:
    """Two episodes of a, b, a: a's view holds b's turn as context (mask 0)."""
    engine = RoleEngine({"a": ["12", "345", "6", "78"], "b": ["no", "yes"]})
    ma = MultiAgentConfig(
        roles=[{"name": "a", "prompt": "a"}, {"name": "b", "prompt": "b"}], turns=["a", "b", "a"]
    )
    group = asyncio.run(rollout(ctx_for(engine, ma, n=2), {"prompt": "3+4", "answer": "7"}))
    # role rewards chosen by hand: a right in episode 0 only, b in episode 1 only
    for s in group.samples:
        s.reward = float((s.metadata["role"] == "a") == (s.metadata["episode"] == 0))
    return [group]


def _reference_grads(model_dir, batch, advantages, mask) -> torch.Tensor:
    """d/dθ of -(1/N) Σ_b Σ_t m[b,t] A[b,t] logp[b,t], N = Σ m, one plain forward per view."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    total = 0.0
    for b, s in enumerate(batch.samples):
        resp = s.response_ids
        ids = torch.tensor([s.prompt_ids + resp])
        logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(resp)[:, None])[:, 0]
        n = len(resp)
        total = total - (mask[b, :n] * advantages[b, :n] * logp).sum()
    (total / mask.sum()).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_each_role_trains_only_its_own_tokens_with_its_own_advantages(tiny_model_dir):
    groups = _episodes()
    a_view = next(s for s in groups[0].samples if s.metadata["role"] == "a")
    assert 0 in a_view.loss_mask and a_view.loss_mask[-1] == 1  # b's turn sits inside a's view
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
    batch = make_batch(groups, version=0)
    assert batch.group_ids.tolist() == [0, 1, 0, 1]  # (prompt, a), (prompt, b)
    # engine log-probs as a rollout records them: the policy's at trained tokens, 0 elsewhere
    batch.rollout_logprobs = actor.logprobs(actor.model, batch) * batch.response_mask
    actor.train(batch)
    got = torch.cat([p.grad.flatten() for p in actor.model.parameters()])

    adv = algo.compute_advantages("grpo", batch.rewards, batch.response_mask, batch.group_ids)
    # rewards a: (1, 0), b: (0, 1): mean 1/2, unbiased std sqrt(1/2) -> A = +-(1/2) / sqrt(1/2)
    signs = [1, -1, -1, 1]
    for b, sign in enumerate(signs):
        m = batch.response_mask[b] > 0
        assert torch.allclose(adv.advantages[b][m], torch.tensor(sign * 0.5 / (0.5**0.5 + 1e-6)))
        assert (adv.advantages[b][~m] == 0).all()
    expected = _reference_grads(tiny_model_dir, batch, adv.advantages, batch.response_mask)
    assert got.abs().max() > 1e-4
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-4)

    # sharpness: training the other role's tokens inside a view, or pooling the roles into one
    # group per prompt, gives a different gradient
    lengths = torch.tensor([[len(s.response_ids)] for s in batch.samples])
    everything = (torch.arange(batch.response_mask.shape[1])[None] < lengths).float()
    leak = _reference_grads(
        tiny_model_dir, batch, adv.advantages[:, -1:].expand_as(everything) * everything, everything
    )
    assert not torch.allclose(got, leak, atol=1e-6, rtol=1e-3)
    pooled = algo.compute_advantages(
        "grpo", batch.rewards, batch.response_mask, torch.zeros(4, dtype=torch.long)
    )
    mixed = _reference_grads(tiny_model_dir, batch, pooled.advantages, batch.response_mask)
    assert not torch.allclose(got, mixed, atol=1e-6, rtol=1e-3)


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory) -> str:
    """Both roles warm-started by SFT on the CI-sized config (shared by the tests below)."""
    return str(weir.sft(QUICK, [f"run.dir={tmp_path_factory.mktemp('ma') / 'sft'}"]))


@pytest.mark.slow
def test_relay_roles_and_team_learn_together(warm_model, tmp_path):
    result = weir.run(QUICK, [f"run.dir={tmp_path / 'rl'}", f"model.path={warm_model}"])
    hist = [h for h in result.history if "reward/first/own_mean" in h]
    assert len(hist) == 12

    # Measured (seeds 0 and 1 of this config, 2026-11-22; seed 0 is the one run here), greedy
    # held-out accuracy after SFT -> after the 12 steps: team 5% -> 69% and 15% -> 44%, first
    # 24% -> 89% and 47% -> 61%, second 50% -> 74% and 32% -> 56%. Sampled reward, step 1 ->
    # mean of the last three: first 0.33 -> 0.48 and 0.29 -> 0.42, team 0.12 -> 0.38 and
    # 0.13 -> 0.23; the second's sampled reward rose 0.27 -> 0.38 and 0.23 -> 0.24 (too little
    # in 12 steps to assert; it rises over the demo's 60).
    before, after = result.evals[0], result.evals[-1]
    for key in ("eval/accuracy", "eval/first/accuracy", "eval/second/accuracy"):
        assert after[key] > before[key] + 0.10, (key, before[key], after[key])
    for key in ("reward/first/own_mean", "reward/team/mean"):
        start, end = hist[0][key], sum(h[key] for h in hist[-3:]) / 3
        assert end > start + 0.05, (key, start, end)
    lines = [json.loads(x) for x in (result.dir / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward/first/mean", "reward/second/std", "response/second/length_mean"):
        assert key in lines[-1], key
    assert lines[-1]["mismatch/abs_logp_diff"] < 1e-4


@pytest.mark.slow
def test_multi_agent_episodes_train_in_the_async_loop(warm_model, tmp_path):
    result = weir.run(
        QUICK,
        [
            f"run.dir={tmp_path / 'async'}",
            f"model.path={warm_model}",
            "loop.mode=async",
            "loop.max_staleness=1",
            "run.steps=3",
            "run.save_model=false",
        ],
    )
    steps = [h for h in result.history if "reward/second/mean" in h]
    assert len(steps) == 3
    for h in steps:
        # 16 prompts x 8 episodes: a view of first each, one of second unless first's turn ran
        # out of tokens; all of them trained
        assert h["rollout/first/samples"] == 16 * 8
        assert h["rollout/second/samples"] >= 0.9 * 16 * 8
        assert h["batch/samples"] == h["rollout/first/samples"] + h["rollout/second/samples"]
        assert 0.0 <= h["reward/team/mean"] <= 1.0
    assert max(h["staleness/max"] for h in steps) <= 1
