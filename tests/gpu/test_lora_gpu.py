"""LoRA on a GPU: fp32 masters with bf16 compute train only the adapters, and the bf16 engine's
merged copy samples with the trainer's log-probs (to bf16 rounding)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.toy import toy_groups
from weir.config import build_config
from weir.engine.base import SamplingParams
from weir.loop.components import make_engine
from weir.train.actor import ActorSettings
from weir.train.batch import make_batch
from weir.train.lora import LoraActor, apply_lora, lora_layers
from weir.train.packing import response_logprobs

pytestmark = pytest.mark.gpu
pytest.importorskip("peft")

CUDA = torch.device("cuda", 0)


def _lora(tiny_model_dir, *extra: str):
    cfg = build_config(
        {},
        ["rollout.batch_prompts=2", "rollout.n=4", "lora.enabled=true", "train.lr=1e-2", *extra],
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(CUDA)
    model = apply_lora(model, cfg.lora, seed=0)
    return cfg, model, LoraActor(model, ActorSettings.from_config(cfg))


def test_lora_step_on_cuda_trains_only_the_adapters(tiny_model_dir):
    cfg, model, actor = _lora(tiny_model_dir)
    assert actor.precision.mixed  # fp32 masters, bf16 compute
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    batch = make_batch(toy_groups(), version=0)
    batch.rollout_logprobs = actor.logprobs(actor.model, batch)
    stats = actor.train(batch)
    assert math.isfinite(stats["train/grad_norm"]) and stats["train/grad_norm"] > 0
    now = dict(model.named_parameters())
    assert all(torch.equal(now[n], p) for n, p in frozen.items())
    for _, layer in lora_layers(model):
        b = layer.lora_B["default"].weight
        assert b.device.type == "cuda" and b.dtype == torch.float32 and b.abs().max() > 0


def test_bf16_engine_holds_merged_weights_and_matches_the_trainer(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg, model, actor = _lora(tiny_model_dir, "engine.kv_idle_release_s=null")
    engine = make_engine(cfg, model, tokenizer)
    try:
        assert next(engine.model.parameters()).dtype == torch.bfloat16
        g = torch.Generator(device="cpu").manual_seed(0)
        with torch.no_grad():
            for _, layer in lora_layers(model):
                for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                    p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(CUDA))
        engine.update_weights_sync(actor.weights(), 1)
        prompts = [[5, 17, 40, 99, 7], [8, 9, 120, 33]]
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=1)
        comps = [c for group in engine.generate_many(prompts, params) for c in group]
        seqs = [prompts[i // 2] + list(c.token_ids) for i, c in enumerate(comps)]
        lens = [len(c.token_ids) for c in comps]
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            trainer = response_logprobs(model.eval(), seqs, lens, layout="padded").logprobs
        diffs = torch.cat(
            [
                (torch.tensor(c.logprobs) - trainer[i, : lens[i]].float().cpu()).abs()
                for i, c in enumerate(comps)
            ]
        )
        assert diffs.mean() < 2e-2, diffs  # bf16 rounding (weir's self-check tolerance)
    finally:
        engine.close()
