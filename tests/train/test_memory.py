"""Memory: chunked log-probs and entropy without full-vocabulary float32 copies, and activation
checkpointing that takes effect. Peaks are measured with tests/memory_probe.py (bytes requested
from the allocator under a dispatch mode; see its docstring for what it counts)."""

from __future__ import annotations

import copy

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, Qwen3Config

from tests.memory_probe import AllocationPeak
from tests.toy import toy_groups
from weir.algo import entropy_from_logits, logprobs_from_logits
from weir.config import build_config
from weir.engine import SamplingParams, TorchEngine
from weir.train.actor import Actor, ActorSettings, grad_mode, prepare_for_training
from weir.train.batch import make_batch
from weir.train.packing import response_logprobs


def test_chunked_logprobs_equal_the_full_computation_with_a_bounded_peak():
    n, v, chunk = 1024, 4096, 128
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(n, v, generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, v, (n,), generator=g)
    weights = torch.randn(n, generator=g)

    ref = base.double().requires_grad_(True)  # float64 reference, unchunked
    ref_lp = torch.log_softmax(ref, -1).gather(1, ids[:, None])[:, 0]
    p = torch.softmax(ref, -1)
    ref_h = -(p * torch.log_softmax(ref, -1)).sum(-1)
    ((ref_lp + ref_h) * weights).sum().backward()

    logits = base.clone().requires_grad_(True)
    with AllocationPeak() as mem:
        lp = logprobs_from_logits(logits, ids, chunk)
        h = entropy_from_logits(logits, chunk)
        ((lp + h) * weights).sum().backward()
    assert torch.allclose(lp.double(), ref_lp.detach(), atol=2e-5)
    assert torch.allclose(h.double(), ref_h.detach(), atol=2e-5)
    assert torch.allclose(logits.grad.double(), ref.grad, atol=1e-2, rtol=1e-2)  # bf16 gradient
    full_fp32 = n * v * 4
    # the bf16 gradient (n * v * 2, twice: one per function, summed) plus a few chunk temporaries
    assert mem.largest < full_fp32, mem.largest
    assert mem.peak <= 3 * n * v * 2 + 8 * chunk * v * 4, mem.peak

    naive = base.clone().requires_grad_(True)
    with AllocationPeak() as full:
        f = naive.float()
        lp2 = torch.log_softmax(f, -1).gather(1, ids[:, None])[:, 0]
        h2 = -(torch.softmax(f, -1) * torch.log_softmax(f, -1)).sum(-1)
        ((lp2 + h2) * weights).sum().backward()
    assert full.largest >= full_fp32 and mem.peak < full.peak / 2


def test_the_trainer_forward_makes_no_full_vocabulary_float32_copy():
    """bf16 compute: the LM head's logits are bf16; nothing of tokens x vocab x 4 bytes appears."""
    config = Qwen3Config(
        vocab_size=16384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    cfg = build_config({}, ["train.compute_dtype=bfloat16", "train.logprob_chunk_tokens=64"])
    actor = Actor(model, ActorSettings.from_config(cfg))
    seqs = [list(range(5, 5 + 160))] * 4
    lens = [128] * 4
    with AllocationPeak() as mem:
        out = actor._forward(model, seqs, lens, with_entropy=True, entropy_grad=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
    tokens = sum(lens)
    assert mem.largest < tokens * config.vocab_size * 4, (mem.largest, tokens * config.vocab_size)


def _deep_model() -> torch.nn.Module:
    """Eight layers and a small vocabulary: activations, not logits, dominate the memory."""
    config = Qwen3Config(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _grads_and_peak(checkpointing: bool) -> tuple[list[torch.Tensor], int, int, int]:
    model = prepare_for_training(_deep_model(), checkpointing=checkpointing)
    seqs = [list(range(3, 3 + n)) for n in (120, 90, 150, 60)]
    lens = [40, 30, 50, 20]
    with grad_mode(model, checkpointing), AllocationPeak() as mem:
        response_logprobs(model, seqs, lens, layout="padded").logprobs.sum().backward()
    assert not model.training  # back in eval mode: a colocated engine keeps its KV cache
    grads = [p.grad.clone() for p in model.parameters()]
    with grad_mode(model, checkpointing), FlopCounterMode(display=False) as flops:
        out = response_logprobs(model, seqs, lens, layout="padded")
        forward = flops.get_total_flops()
        out.logprobs.sum().backward()
    return grads, mem.peak, forward, flops.get_total_flops() - forward


def test_gradient_checkpointing_takes_effect_with_equal_gradients_and_a_lower_peak():
    plain, peak_plain, fwd_plain, bwd_plain = _grads_and_peak(False)
    ckpt, peak_ckpt, fwd_ckpt, bwd_ckpt = _grads_and_peak(True)
    # the backward recomputes the decoder layers' forward (all of the forward but the LM head)
    assert fwd_ckpt == fwd_plain
    assert bwd_plain + 0.5 * fwd_plain < bwd_ckpt <= bwd_plain + fwd_plain
    for a, b in zip(plain, ckpt, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert peak_ckpt < 0.5 * peak_plain, (peak_ckpt, peak_plain)


def test_actor_with_checkpointing_trains_like_without(tiny_model_dir):
    grads = []
    for ckpt in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        cfg = build_config(
            {},
            [
                "rollout.batch_prompts=2",
                "rollout.n=4",
                f"train.gradient_checkpointing={ckpt}",
                "train.grad_clip=null",
            ],
        )
        actor = Actor(model, ActorSettings.from_config(cfg))
        actor.train(make_batch(toy_groups(), version=0))
        assert not model.training
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_an_engine_copied_from_a_checkpointing_trainer_keeps_its_direct_decode(tiny_model_dir):
    """HF's checkpointing hooks the input embeddings (for reentrant checkpointing, which weir does
    not use); an engine built on a copy of the trainer's model would inherit the hook and fall back
    from its direct decode forward and CUDA graphs (half the decode speed on an H100)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = build_config(
        {}, ["rollout.batch_prompts=2", "rollout.n=4", "train.gradient_checkpointing=true"]
    )
    Actor(model, ActorSettings.from_config(cfg)).train(make_batch(toy_groups(), version=0))
    with TorchEngine(copy.deepcopy(model), eos_token_ids=[1], pad_token_id=0) as engine:
        engine.generate_many([[5, 6, 7]], SamplingParams(max_new_tokens=4))
        assert engine.stats()["decode_direct"] == 1.0
