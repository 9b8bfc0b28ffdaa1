"""Routing replay (R3): the engine records each MoE layer's experts, the sample carries them, and the
trainer's forward replays them, so that it computes the engine's log-probs where its own routers
would pick other experts.

The flip is constructed: two experts of every router get (nearly) the same router row, ``3 v``,
which makes them the top-1 of every token; the trainer's copy adds ``+eps u`` to the second, the
engine's copy ``-eps u``, so for every token the two rank the pair in opposite order, a tie broken
the other way (what another kernel, batch or precision does to a near tie). With one expert per
token the gate weight is exactly 1 whichever logits chose it, so replaying the engine's picks makes
the trainer compute the engine's function exactly; without replay every token goes through the
other expert.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from weir.config import build_config
from weir.data.moe_routing import (
    ROUTERS,
    UnsupportedRouting,
    install_routing,
    recording,
    replaying,
)
from weir.data.sample import Group, Sample
from weir.engine import SamplingParams, TorchEngine
from weir.tasks.tiny_archs import arch_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch

EXACT = 1e-5
# the layouts each architecture trains with (GPT-OSS: padded only, docs/models.md; the prefix
# layout refuses sliding windows)
LAYOUTS = {
    "qwen3_moe": ["packed", "padded", "prefix"],
    "gpt_oss": ["padded"],
    "deepseek_v3": ["packed", "padded", "prefix"],
}
CASES = [(arch, layout) for arch, layouts in LAYOUTS.items() for layout in layouts]


def _tie(model: torch.nn.Module, eps: float) -> None:
    """Experts 0 and 1 of every router: rows ``3 v`` and ``3 v + eps u`` (module docstring)."""
    name = ROUTERS[model.config.model_type][0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == name:
                v, u = torch.randn(2, m.weight.shape[1], generator=g)
                m.weight.mul_(0.1)
                m.weight[0] = 3 * v
                m.weight[1] = 3 * v + eps * u
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()


def _pair(arch: str, top_k: int = 1) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(trainer model, engine model): the same weights but for the near-tied router rows."""
    over = {"num_experts_per_tok": top_k}
    if arch == "deepseek_v3":
        over["routed_scaling_factor"] = 1.0
    torch.manual_seed(0)
    trainer = AutoModelForCausalLM.from_config(
        arch_config(arch, **over), attn_implementation="eager"
    ).eval()
    engine = copy.deepcopy(trainer)
    _tie(trainer, 1e-3)
    _tie(engine, -1e-3)
    return trainer, engine


def _samples(engine_model) -> list[Group]:
    """Two samples of each of three prompts (the samples of a prompt share its prefill), recorded."""
    engine = TorchEngine(
        engine_model, eos_token_ids=[1], pad_token_id=0, seed=0, record_routing=True
    )
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    try:
        outs = engine.generate_many(
            prompts, SamplingParams(n=2, max_new_tokens=10, temperature=1.0, seed=3)
        )
    finally:
        engine.close()
    groups = []
    for g, (p, comps) in enumerate(zip(prompts, outs, strict=True)):
        samples = []
        for i, c in enumerate(comps):
            assert c.routed_experts.shape[0] == len(p) + len(c.token_ids) - 1
            samples.append(
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
            )
        groups.append(Group(samples=samples, group_id=g))
    return groups


@pytest.mark.parametrize("arch, layout", CASES)
def test_replay_reproduces_the_engines_logprobs(arch, layout):
    trainer, engine_model = _pair(arch)
    batch = make_batch(_samples(engine_model), version=0)
    opts = [f"train.packing={layout}", "rollout.batch_prompts=3", "rollout.n=2"]
    actor = Actor(
        trainer, ActorSettings.from_config(build_config({}, [*opts, "algo.routing_replay=true"]))
    )
    m = batch.response_mask.bool()
    replayed = actor.logprobs(actor.model, batch)
    own = actor.logprobs(actor.model, batch, replay=False)
    assert (replayed - batch.rollout_logprobs)[m].abs().max() < EXACT
    assert (own - batch.rollout_logprobs)[m].abs().max() > 0.05  # the flip is real


def test_replaying_the_models_own_routing_changes_nothing_and_trains_the_router():
    """Top-2 routing, replayed from the model's own record: the same logits and gradients as its
    own routers', and the router weights get their gradient through the gate weights."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(arch_config("qwen3_moe")).eval()
    spec = install_routing(model)
    ids = torch.randint(5, 200, (2, 9))
    with torch.no_grad(), recording(spec) as rec:
        model(input_ids=ids)
    routes = rec.stacked(2, 9).long().view(18, spec.layers, spec.top_k)

    def grads(replay):
        model.zero_grad()
        with replaying(replay):
            out = model(input_ids=ids).logits
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    own, g_own = grads(None)
    rep, g_rep = grads(routes)
    assert torch.equal(own, rep)
    assert all(torch.equal(g_own[n], g_rep[n]) for n in g_own)
    router = [n for n in g_rep if n.endswith("mlp.gate.weight")]
    assert router and all(g_rep[n].abs().sum() > 0 for n in router)


def test_checkpointed_recomputation_replays_too():
    """With activation checkpointing the backward reruns each layer outside the replay context;
    the checkpoint function restores it, so the gradient is the replayed forward's."""
    from weir.train.modes import grad_mode, prepare_for_training

    trainer, engine_model = _pair("qwen3_moe")
    spec_e = install_routing(engine_model)
    ids = torch.randint(5, 200, (1, 12))
    with torch.no_grad(), recording(spec_e) as rec:
        engine_model(input_ids=ids)
    routes = rec.stacked(1, 12).long().view(12, spec_e.layers, 1)
    install_routing(trainer)
    plain = copy.deepcopy(trainer)
    ckpt = prepare_for_training(copy.deepcopy(trainer), checkpointing=True)

    def grad(model, checkpointing):
        with grad_mode(model, checkpointing), replaying(routes):
            loss = model(input_ids=ids).logits.square().mean()
        loss.backward()  # outside the replay context, as the actor's backward is
        return loss.detach(), [p.grad for p in model.parameters()]

    loss_a, g_a = grad(plain, False)
    loss_b, g_b = grad(ckpt, True)
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(g_a, g_b, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


def test_the_sample_carries_its_routing_through_a_buffer_checkpoint():
    from weir.buffer.buffer import _group_from_dict, _group_to_dict

    _, engine_model = _pair("qwen3_moe")
    group = _samples(engine_model)[0]
    back = _group_from_dict(copy.deepcopy(_group_to_dict(group)))
    for a, b in zip(group.samples, back.samples, strict=True):
        assert a.routed_experts.dtype == torch.uint8  # 4 experts: one byte per pick
        assert torch.equal(a.routed_experts, b.routed_experts)


def test_a_dense_model_is_refused_in_one_line():
    model = AutoModelForCausalLM.from_config(arch_config("qwen3"))
    with pytest.raises(UnsupportedRouting, match="no mixture-of-experts router") as err:
        install_routing(model)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_server_engines_are_refused_with_the_reason(engine):
    with pytest.raises(ValueError, match="returns no routed experts|does not read them"):
        build_config({}, ["algo.routing_replay=true", f"engine.type={engine}"])


@pytest.mark.slow
def test_a_run_replays_what_its_engine_recorded(tmp_path):
    """`weir train`'s sync loop on a tiny Qwen3-MoE with algo.routing_replay: every sample reaches
    the trainer with its routing, and engine and trainer agree to rounding."""
    from weir.config import load_config
    from weir.loop.sync import run_sync
    from weir.tasks.tiny_archs import build_arch_model

    model_dir = build_arch_model(tmp_path / "moe", "qwen3_moe", seed=0)
    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            f"run.dir={tmp_path / 'run'}",
            "run.steps=2",
            "run.eval_every=0",
            "run.save_model=false",
            "run.checkpoint_every=0",
            "data.task=arithmetic",
            "data.eval_size=2",
            "rollout.n=4",
            "rollout.batch_prompts=2",
            "rollout.max_new_tokens=8",
            "train.dead_rows=forward",
            "algo.routing_replay=true",
            "telemetry.console=false",
        ],
    )
    history = run_sync(cfg).history
    steps = [h for h in history if "routing/unrecorded_samples" in h]
    assert len(steps) == 2
    assert all(h["routing/unrecorded_samples"] == 0 for h in steps)
    assert all(h["mismatch/abs_logp_diff"] < EXACT for h in steps)


def test_a_router_that_does_not_run_is_an_error_not_a_silent_forward():
    """A fused MoE kernel that bypasses the router module (as a hub kernel may for GPT-OSS on a GPU)
    would leave its layer on the trainer's own routing: the replay says so."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(arch_config("qwen3_moe")).eval()
    spec = install_routing(model)
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    routers[1]._forward_hooks.clear()  # layer 1's router "bypassed"
    routes = torch.zeros(5, spec.layers, spec.top_k, dtype=torch.long)
    ids = torch.randint(5, 200, (1, 5))
    with (
        pytest.raises(RuntimeError, match=r"MoE layers \[1\] did not run"),
        torch.no_grad(),
        replaying(routes),
    ):
        model(input_ids=ids)


def test_a_continued_conversation_keeps_its_cached_prefix_routing():
    """Multi-turn: the next turn reuses the finished turn's KV (the prefix cache); its record starts
    with the routing of that KV, not a new one, and covers the whole conversation."""
    _, engine_model = _pair("qwen3_moe")
    engine = TorchEngine(
        engine_model, eos_token_ids=[1], pad_token_id=0, seed=0, record_routing=True
    )
    prompt = [5, 6, 7, 8, 9]
    try:
        probe = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
        (draft,) = engine.generate_many([prompt], probe)[0]
        # the same draw again, now ending with a stop token (kept only then) and keeping its KV
        stop = SamplingParams(
            max_new_tokens=6,
            temperature=1.0,
            seed=5,
            stop_token_ids=[draft.token_ids[2]],
            keep_kv=True,
        )
        (first,) = engine.generate_many([prompt], stop)[0]
        assert first.finish_reason == "stop"
        turn2 = prompt + first.token_ids + [20, 21, 22]
        (second,) = engine.generate_many([turn2], probe)[0]
        reused = engine.stats()["prefix_reused_tokens"]
    finally:
        engine.close()
    assert reused > 0
    assert second.routed_experts.shape[0] == len(turn2) + len(second.token_ids) - 1
    n = first.routed_experts.shape[0]
    assert torch.equal(second.routed_experts[:n], first.routed_experts)
