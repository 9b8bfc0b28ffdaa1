"""LoRA through peft: merged weights for the engine, the reference, adapter dropout, what trains."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.toy import toy_groups
from weir.config import build_config
from weir.engine.base import SamplingParams
from weir.loop.components import make_engine
from weir.train.batch import make_batch
from weir.train.lora import LoraActor, adapter_dropout, apply_lora, lora_layers, merged_weights
from weir.train.packing import response_logprobs

pytest.importorskip("peft")

TARGETS = ("q_proj", "v_proj", "down_proj")


def _cfg(*extra: str):
    return build_config(
        {},
        [
            "rollout.batch_prompts=2",
            "rollout.n=4",
            "lora.enabled=true",
            f"lora.target_modules=[{','.join(TARGETS)}]",
            *extra,
        ],
    )


def _randomize_adapters(model, seed: int = 0, scale: float = 0.05) -> None:
    """B starts at zero (the adapter is a no-op); give A and B values so the merge matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _adapter_tensors(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) per adapted layer, keyed by the plain model's weight name."""
    return {
        f"{name}.weight": (
            layer.lora_A["default"].weight.detach().clone(),
            layer.lora_B["default"].weight.detach().clone(),
        )
        for name, layer in lora_layers(model)
    }


@pytest.mark.parametrize(("rank", "alpha", "rslora"), [(4, 8.0, False), (2, 3.0, True)])
def test_merged_weights_are_w_plus_scaled_b_a(tiny_model_dir, rank, alpha, rslora):
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    cfg = _cfg(f"lora.rank={rank}", f"lora.alpha={alpha}", f"lora.rslora={rslora}")
    model = apply_lora(plain, cfg.lora)
    _randomize_adapters(model)
    ab = _adapter_tensors(model)
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    merged = dict(merged_weights(model))
    assert list(merged) == list(before)  # the plain model's names, in its order
    n_layers = plain.config.num_hidden_layers
    assert len(ab) == len(TARGETS) * n_layers
    for name, w in before.items():
        if name in ab:
            a, b = ab[name]
            assert a.shape[0] == rank and b.shape[1] == rank
            expected = w + scale * (b @ a)
            assert torch.allclose(merged[name], expected, atol=1e-6), name
            assert (merged[name] - w).abs().max() > 1e-4  # the adapter changes the weight
        else:
            assert torch.equal(merged[name], w), name


@pytest.mark.hf_compat  # also run against the oldest supported transformers
def test_engine_gets_merged_weights_and_matches_trainer_logprobs(tiny_model_dir):
    """After a sync the engine's weights are W + (alpha/r) B A and its sampled log-probs are the
    trainer's LoRA model's (to float rounding: the merged and unmerged products round differently)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base_q = plain.model.layers[1].self_attn.q_proj.weight.detach().clone()
    cfg = _cfg("lora.rank=4", "lora.alpha=16", "lora.dropout=0.3", "engine.kv_idle_release_s=null")
    model = apply_lora(plain, cfg.lora)
    actor = LoraActor(model, _settings(cfg))
    engine = make_engine(cfg, model, tokenizer)
    try:
        assert engine.model is not model and not any(
            "lora" in n for n, _ in engine.model.named_parameters()
        )
        _randomize_adapters(model, seed=1)
        a, b = _adapter_tensors(model)["model.layers.1.self_attn.q_proj.weight"]
        engine.update_weights_sync(actor.weights(), 1)
        q = engine.model.get_parameter("model.layers.1.self_attn.q_proj.weight")
        assert torch.allclose(q, base_q + 4.0 * (b @ a), atol=1e-6)
        prompts = [[5, 17, 40, 99, 7], [8, 9, 120, 33]]
        params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=3)
        comps = [c for group in engine.generate_many(prompts, params) for c in group]
        seqs = [p for p in prompts for _ in range(3)]
        full = [s + list(c.token_ids) for s, c in zip(seqs, comps, strict=True)]
        lens = [len(c.token_ids) for c in comps]
        with torch.no_grad():
            trainer = response_logprobs(model.eval(), full, lens, layout="padded").logprobs
        for i, c in enumerate(comps):
            got = torch.tensor(c.logprobs)
            assert torch.allclose(got, trainer[i, : lens[i]], atol=2e-5), (got, trainer[i])
        # the same with the adapters off is measurably different: the check above has teeth
        with torch.no_grad(), model.disable_adapter():
            base = response_logprobs(model, full, lens, layout="padded").logprobs
        assert (base - trainer).abs().max() > 1e-2
    finally:
        engine.close()


def _settings(cfg):
    from weir.train.actor import ActorSettings

    return ActorSettings.from_config(cfg)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_reference_is_the_base_model_and_dropout_only_in_the_gradient_forward(
    tiny_model_dir, checkpointing
):
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    cfg = _cfg(
        "lora.dropout=0.5",
        "algo.kl.coef=0.1",
        f"train.gradient_checkpointing={str(checkpointing).lower()}",
    )
    model = apply_lora(plain, cfg.lora)
    actor = LoraActor(model, _settings(cfg))
    _randomize_adapters(model, seed=2)
    batch = make_batch(toy_groups(), version=0)
    with torch.no_grad():
        expected_ref = response_logprobs(
            base,
            batch.sequences,
            batch.response_lengths,
            layout="padded",
            pad_to=batch.response_mask.shape[1],
        ).logprobs
    ref = actor.logprobs(actor.ref, batch)
    m = batch.response_mask.bool()
    assert torch.allclose(ref[m], expected_ref[m], atol=1e-5)
    policy = actor.logprobs(actor.model, batch)
    assert (policy[m] - ref[m]).abs().max() > 1e-3  # the policy is not the reference
    assert torch.equal(policy, actor.logprobs(actor.model, batch))  # no dropout outside training
    drops = [m for _, layer in lora_layers(model) for m in layer.lora_dropout.values()]
    assert drops and all(d.p == 0.5 for d in drops)  # checkpointing zeroes other dropouts only
    with torch.no_grad(), adapter_dropout(model):
        noisy = response_logprobs(
            model,
            batch.sequences,
            batch.response_lengths,
            layout="padded",
            pad_to=batch.response_mask.shape[1],
        ).logprobs
    assert (noisy[m] - policy[m]).abs().max() > 1e-3
    assert not any(d.training for d in drops)


def test_only_the_adapters_train_and_hold_optimizer_state(tiny_model_dir):
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = _cfg("train.lr=1e-2", "lora.rank=2")
    model = apply_lora(plain, cfg.lora)
    actor = LoraActor(model, _settings(cfg))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_A" in n or "lora_B" in n for n in adapters)
    batch = make_batch(toy_groups(), version=0)
    batch.rollout_logprobs = actor.logprobs(actor.model, batch)
    stats = actor.train(batch)
    assert stats["train/grad_norm"] > 0
    now = dict(model.named_parameters())
    assert all(torch.equal(now[n], p) for n, p in frozen.items())
    assert all(not torch.equal(now[n], p) for n, p in adapters.items() if "lora_B" in n)
    state = actor.optimizer.state_dict()["state"]
    n_adapter = sum(p.numel() for p in adapters.values())
    assert sum(s["exp_avg"].numel() for s in state.values()) == n_adapter
    # rank 2 on q, v, down of every layer: 2 * (in + out) per layer, worked out from the config
    c = plain.config
    head = c.head_dim
    per_layer = 2 * (c.hidden_size + c.num_attention_heads * head)
    per_layer += 2 * (c.hidden_size + c.num_key_value_heads * head)
    per_layer += 2 * (c.intermediate_size + c.hidden_size)
    assert n_adapter == per_layer * c.num_hidden_layers


def test_unknown_target_modules_are_refused_naming_the_layers(tiny_model_dir):
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = _cfg("lora.target_modules=[qkv_proj]")
    with pytest.raises(ValueError, match=r"lora.target_modules=\['qkv_proj'\].*q_proj") as err:
        apply_lora(plain, cfg.lora)
    assert "\n" not in str(err.value)


def test_a_tied_output_head_is_refused(tiny_model_dir):
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight  # tie_word_embeddings
    with pytest.raises(ValueError, match="lm_head shares its weight"):
        apply_lora(plain, _cfg("lora.target_modules=[q_proj,lm_head]").lora)


def test_an_adapter_only_sync_needs_an_engine_that_applies_adapters():
    with pytest.raises(Exception, match="lora.sync=adapter sends only the adapter"):
        build_config({}, ["lora.enabled=true", "lora.sync=adapter", "engine.type=torch"])
