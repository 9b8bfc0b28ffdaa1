"""The direct decode forward (weir.engine.decode.DecodeForward): the same tokens and log-probs as the
HF forward, on every architecture it takes, and the HF forward wherever it cannot be exact."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import EOS, PAD, assert_parity, make_prompts
from transformers import AutoModelForCausalLM

from weir.engine import SamplingParams, TorchEngine
from weir.engine.decode import DecodeForward, forwards_agree, logprob_gap
from weir.tasks.tiny_archs import WINDOW, build_arch_model

# Long enough that the sliding layers (window 8) drop keys while decoding.
SAMPLING = SamplingParams(n=3, max_new_tokens=24, temperature=0.9, top_k=50, seed=11)


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("direct_decode")
    return {
        name: build_arch_model(root / name, name, seed=5)
        for name in ("llama3", "qwen2", "qwen3", "mistral", "gemma2")
    }


def generate(model, prompts, params, **kw):
    with TorchEngine(model, eos_token_ids=[EOS], pad_token_id=PAD, **kw) as engine:
        results = engine.generate_many(prompts, params)
        return results, engine.stats()["decode_direct"]


def assert_same(a, b):
    for ca, cb in zip(a, b, strict=True):
        for x, y in zip(ca, cb, strict=True):
            assert x.token_ids == y.token_ids
            assert x.logprobs == y.logprobs
            assert x.finish_reason == y.finish_reason


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_direct_decode_matches_the_hf_forward_bit_for_bit(arch_dirs, arch, attn):
    model = AutoModelForCausalLM.from_pretrained(arch_dirs[arch], attn_implementation=attn).eval()
    prompts = make_prompts(4, 3, 2 * WINDOW, seed=2)
    direct, used = generate(model, prompts, SAMPLING)
    assert used == 1.0
    hf, used_hf = generate(model, prompts, SAMPLING, direct_decode=False)
    assert used_hf == 0.0
    assert_same(direct, hf)
    assert any(len(c.token_ids) > WINDOW for comps in direct for c in comps)
    for prompt, comps in zip(prompts, direct, strict=True):
        for c in comps:
            assert_parity(model, prompt, c, temperature=SAMPLING.temperature)


def test_other_architectures_and_hooked_models_decode_through_hf(arch_dirs):
    gemma = AutoModelForCausalLM.from_pretrained(arch_dirs["gemma2"], attn_implementation="eager")
    assert DecodeForward.build(gemma.eval(), per_layer_type=True) is None
    model = AutoModelForCausalLM.from_pretrained(arch_dirs["qwen3"]).eval()
    assert DecodeForward.build(model, per_layer_type=True) is not None
    seen = []
    # A hook the direct path would skip (as a LoRA or offloading wrapper would be): HF forward.
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(1))
    assert DecodeForward.build(model, per_layer_type=True) is None
    prompts = make_prompts(2, 4, 9, seed=4)
    out, used = generate(model, prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert used == 0.0 and len(seen) > 6
    handle.remove()
    model.forward = model.forward  # a forward replaced on the instance: HF forward too
    assert DecodeForward.build(model, per_layer_type=True) is None
    del model.forward
    assert DecodeForward.build(model, per_layer_type=True) is not None
    for prompt, comps in zip(prompts, out, strict=True):
        assert_parity(model, prompt, comps[0], temperature=0.0)


def test_a_direct_forward_that_differs_is_dropped_after_the_first_step(arch_dirs, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(arch_dirs["llama3"]).eval()
    prompts = make_prompts(3, 4, 12, seed=6)
    reference, _ = generate(model, prompts, SAMPLING, direct_decode=False)
    calls = []
    real = DecodeForward.__call__

    def off_by_a_little(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k) + 1e-6

    monkeypatch.setattr(DecodeForward, "__call__", off_by_a_little)
    out, used = generate(model, prompts, SAMPLING)
    assert used == 0.0 and len(calls) == 1  # compared once, then never used again
    assert_same(out, reference)


def test_direct_decode_across_a_weight_update(arch_dirs):
    """In-place weight updates reach the direct path (it reads the modules' parameters)."""
    model = AutoModelForCausalLM.from_pretrained(arch_dirs["qwen3"]).eval()
    prompts = make_prompts(2, 4, 10, seed=8)
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.0)
    with TorchEngine(model, eos_token_ids=[EOS], pad_token_id=PAD) as engine:
        engine.generate_many(prompts, params)
        g = torch.Generator().manual_seed(0)
        new = {
            name: p + 0.05 * torch.randn(p.shape, generator=g)
            for name, p in model.named_parameters()
        }
        engine.update_weights_sync(new.items(), version=1)
        out = engine.generate_many(prompts, params)
        assert engine.stats()["decode_direct"] == 1.0
    for prompt, comps in zip(prompts, out, strict=True):
        for c in comps:
            assert c.versions == [1] * len(c.token_ids)
            assert_parity(model, prompt, c, temperature=0.0)


def test_direct_decode_in_bfloat16_matches_the_hf_forward(arch_dirs):
    """The RMSNorms' float32 round trip of a bfloat16 model is the HF forward's too."""
    model = AutoModelForCausalLM.from_pretrained(arch_dirs["qwen3"], dtype=torch.bfloat16).eval()
    prompts = make_prompts(3, 3, 14, seed=12)
    direct, used = generate(model, prompts, SAMPLING)
    hf, _ = generate(model, prompts, SAMPLING, direct_decode=False)
    assert used == 1.0
    assert_same(direct, hf)


def _norms(direct: DecodeForward) -> list:
    layers = [(lay.ln1, lay.ln2, lay.q_norm, lay.k_norm) for lay in direct._layers]
    return [direct._norm, *(n for norms in layers for n in norms if n is not None)]


def test_norms_run_as_one_call_only_where_that_gives_the_same_bits(arch_dirs, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(arch_dirs["qwen3"]).eval()
    direct = DecodeForward.build(model, per_layer_type=False)
    assert len(_norms(direct)) == 4 * model.config.num_hidden_layers + 1
    assert all(n.fused for n in _norms(direct))  # torch's rms_norm is the module's formula here
    real = torch.nn.functional.rms_norm

    def one_ulp_off(*a, **k):
        return real(*a, **k) * (1 + 2**-22)

    monkeypatch.setattr(torch.nn.functional, "rms_norm", one_ulp_off)
    assert not any(n.fused for n in _norms(DecodeForward.build(model, per_layer_type=False)))
    prompts = make_prompts(3, 4, 12, seed=8)
    direct_out, used = generate(model, prompts, SAMPLING)
    assert used == 1.0  # the norms written out keep the direct forward exact
    assert_same(direct_out, generate(model, prompts, SAMPLING, direct_decode=False)[0])


def test_the_direct_forward_must_be_exact_on_a_cpu_and_within_rounding_on_cuda():
    """`forwards_agree` decides the first-step check: bit for bit on the CPU; on CUDA a difference
    of bfloat16 rounding passes and a wrong forward's tenths of a nat do not (CPU tensors stand in
    for CUDA ones: the rule reads only the device named)."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(8, 262, generator=g) * 3
    rounded = ref.bfloat16().float()  # each logit one bfloat16 rounding away
    wrong = ref + torch.randn(8, 262, generator=g)  # log-probs moved by about a nat
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert 0 < logprob_gap(rounded, ref) < 2e-2 < 0.1 < logprob_gap(wrong, ref)
    assert forwards_agree(ref.clone(), ref, torch.bfloat16, cpu)
    assert forwards_agree(ref.clone(), ref, torch.float32, cuda)
    assert not forwards_agree(rounded, ref, torch.bfloat16, cpu)
    assert forwards_agree(rounded, ref, torch.bfloat16, cuda)
    assert not forwards_agree(wrong, ref, torch.bfloat16, cuda)
    # float32 on CUDA with TF32 off allows float32 rounding only
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        assert not forwards_agree(rounded, ref, torch.float32, cuda)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
