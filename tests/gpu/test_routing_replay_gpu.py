"""Routing replay on CUDA: the engine's record replayed by the trainer reproduces its float32
log-probs, activation checkpointing recomputes on CUDA's autograd threads with the replayed routing,
and with a bfloat16 engine (the usual GPU setting) replay removes the flips' share of the mismatch.

    python -m pytest -q tests/gpu/test_routing_replay_gpu.py     (about a minute on one GPU)
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from weir.config import build_config
from weir.data.moe_routing import install_routing, recording, replaying
from weir.data.sample import Group, Sample
from weir.engine import SamplingParams, TorchEngine
from weir.tasks.tiny_archs import arch_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch

CUDA = torch.device("cuda")


def _tie(model, eps):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "Qwen3MoeTopKRouter":
                v, u = torch.randn(2, m.weight.shape[1], generator=g).to(m.weight.device)
                m.weight.mul_(0.1)
                m.weight[0] = 3 * v
                m.weight[1] = 3 * v + eps * u


def _groups(engine_model, seed=3):
    engine = TorchEngine(engine_model, eos_token_ids=[1], pad_token_id=0, record_routing=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    try:
        outs = engine.generate_many(
            prompts, SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=seed)
        )
    finally:
        engine.close()
    return [
        Group(
            [
                Sample(
                    prompt_ids=p,
                    response_ids=c.token_ids,
                    rollout_logprobs=c.logprobs,
                    versions=c.versions,
                    reward=float(i),
                    group_id=g,
                    index=i,
                    routed_experts=c.routed_experts,
                )
                for i, c in enumerate(comps)
            ],
            group_id=g,
        )
        for g, (p, comps) in enumerate(zip(prompts, outs, strict=True))
    ]


def _actor(model, *opts):
    cfg = build_config(
        {}, ["algo.routing_replay=true", "rollout.batch_prompts=3", "rollout.n=2", *opts]
    )
    return Actor(model, ActorSettings.from_config(cfg))


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_replay_is_exact_in_float32_on_cuda(layout):
    torch.manual_seed(0)
    cfg = arch_config("qwen3_moe", num_experts_per_tok=1)
    trainer = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(CUDA).eval()
    engine_model = copy.deepcopy(trainer)
    _tie(trainer, 1e-3)
    _tie(engine_model, -1e-3)
    batch = make_batch(_groups(engine_model), version=0)
    actor = _actor(trainer, f"train.packing={layout}", "train.compute_dtype=float32")
    m = batch.response_mask.bool().to(CUDA)
    rollout = batch.rollout_logprobs.to(CUDA)
    assert (actor.logprobs(actor.model, batch) - rollout)[m].abs().max() < 1e-4
    assert (actor.logprobs(actor.model, batch, replay=False) - rollout)[m].abs().max() > 0.05


def test_checkpointed_backward_replays_on_cuda():
    from weir.train.modes import grad_mode, prepare_for_training

    torch.manual_seed(0)
    cfg = arch_config("qwen3_moe", num_experts_per_tok=1)
    model = AutoModelForCausalLM.from_config(cfg).to(CUDA).eval()
    engine_model = copy.deepcopy(model)
    _tie(model, 1e-3)
    _tie(engine_model, -1e-3)
    spec = install_routing(engine_model)
    ids = torch.randint(5, 200, (1, 12), device=CUDA)
    with torch.no_grad(), recording(spec) as rec:
        engine_model(input_ids=ids)
    routes = rec.stacked(1, 12).long().view(12, spec.layers, 1).to(CUDA)
    install_routing(model)
    plain, ckpt = (
        copy.deepcopy(model),
        prepare_for_training(copy.deepcopy(model), checkpointing=True),
    )
    grads = []
    for m, on in ((plain, False), (ckpt, True)):
        with grad_mode(m, on), replaying(routes):
            loss = m(input_ids=ids).logits.float().square().mean()
        loss.backward()  # on CUDA the recomputation runs on autograd's device thread
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_bf16_engine_mismatch_shrinks_with_replay():
    torch.manual_seed(0)
    cfg = arch_config(
        "qwen3_moe",
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        hidden_size=64,
        head_dim=16,
    )
    trainer = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(CUDA).eval()
    engine_model = copy.deepcopy(trainer).to(torch.bfloat16)
    batch = make_batch(_groups(engine_model, seed=0), version=0)
    actor = _actor(trainer, "train.packing=padded", "train.compute_dtype=float32")
    m = batch.response_mask.bool().to(CUDA)
    rollout = batch.rollout_logprobs.to(CUDA)
    own = (actor.logprobs(actor.model, batch, replay=False) - rollout)[m].abs()
    rep = (actor.logprobs(actor.model, batch) - rollout)[m].abs()
    print(
        f"bf16 engine: mean |dlogp| own {own.mean():.3e} replay {rep.mean():.3e}; "
        f"max own {own.max():.3e} replay {rep.max():.3e}"
    )
    assert rep.mean() <= own.mean()
