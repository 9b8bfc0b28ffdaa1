"""The engine's log-probs equal a plain full-sequence forward pass on prompt + response (1e-5, fp32),
however the request was batched."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_parity, make_prompts, wait_steps
from transformers import AutoModelForCausalLM

from weir.engine import SamplingParams
from weir.tasks.tiny_model import build_tiny_model


@pytest.mark.hf_compat  # also run against the oldest supported transformers
def test_single_request(engine, model):
    prompt = make_prompts(1, 12, 12, seed=1)[0]
    (c,) = engine.submit(prompt, SamplingParams(max_new_tokens=24)).result(timeout=30)
    assert 1 <= len(c.token_ids) <= 24
    assert c.versions == [0] * len(c.token_ids)
    assert_parity(model, prompt, c)


@pytest.mark.hf_compat  # also run against the oldest supported transformers
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batched_prompts_of_different_lengths(engine, model, temperature):
    prompts = make_prompts(8, 2, 30, seed=2)
    params = SamplingParams(n=2, max_new_tokens=20, temperature=temperature)
    results = engine.generate_many(prompts, params)
    assert [len(r) for r in results] == [2] * len(prompts)
    for prompt, comps in zip(prompts, results, strict=True):
        for c in comps:
            assert_parity(model, prompt, c, temperature)


def test_n_samples_share_the_prompt(engine, model):
    prompt = make_prompts(1, 15, 15, seed=3)[0]
    comps = engine.submit(prompt, SamplingParams(n=8, max_new_tokens=16)).result(timeout=30)
    assert len(comps) == 8
    assert len({tuple(c.token_ids) for c in comps}) > 1, "the n samples should differ"
    for c in comps:
        assert_parity(model, prompt, c)
    assert engine.stats()["prefill_tokens"] == len(prompt), "the prompt is prefilled once"


def test_requests_joining_mid_flight(make_engine, model):
    engine = make_engine(eos_token_ids=[])
    first = make_prompts(3, 5, 9, seed=4)
    # Joiners both longer (cache extended to the left) and shorter than the running rows.
    joiners = make_prompts(2, 30, 40, seed=5) + make_prompts(2, 2, 4, seed=6)
    params = SamplingParams(n=3, max_new_tokens=120)
    early = engine.submit_many(first, params)
    wait_steps(engine, 4)
    late = []
    for p in joiners:  # one at a time, a few steps apart
        late.append(engine.submit(p, SamplingParams(n=2, max_new_tokens=12)))
        wait_steps(engine, 2)
    engine.pause_sync()
    assert not any(f.done() for f in early), "the first requests should still be running"
    engine.resume_sync()
    for prompts, futures in ((first, early), (joiners, late)):
        for prompt, fut in zip(prompts, futures, strict=True):
            for c in fut.result(timeout=30):
                assert_parity(model, prompt, c)


def test_many_requests_through_a_small_batch(make_engine, model):
    """Queueing, rows leaving and joining continuously, slabs reused and regrown."""
    engine = make_engine(max_batch_size=5)
    prompts = make_prompts(12, 1, 25, seed=7)
    params = [
        SamplingParams(n=1 + i % 3, max_new_tokens=3 + 5 * (i % 4)) for i in range(len(prompts))
    ]
    results = engine.generate_many(prompts, params)
    for prompt, sp, comps in zip(prompts, params, results, strict=True):
        assert len(comps) == sp.n
        for c in comps:
            assert len(c.token_ids) <= sp.max_new_tokens
            assert_parity(model, prompt, c)


def test_prefill_budget_splits_admission(make_engine, model):
    engine = make_engine(max_prefill_tokens=40)
    prompts = make_prompts(6, 15, 20, seed=8)
    results = engine.generate_many(prompts, SamplingParams(n=2, max_new_tokens=10))
    for prompt, comps in zip(prompts, results, strict=True):
        for c in comps:
            assert_parity(model, prompt, c)


@pytest.mark.hf_compat  # also run against the oldest supported transformers
def test_eager_attention_and_llama(tmp_path, make_engine):
    path = build_tiny_model(tmp_path / "llama", size="nano", arch="llama", seed=3)
    for attn in ("eager", "sdpa"):
        m = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()
        engine = make_engine(m)
        prompts = make_prompts(4, 3, 17, seed=9)
        results = engine.generate_many(prompts, SamplingParams(n=2, max_new_tokens=12))
        for prompt, comps in zip(prompts, results, strict=True):
            for c in comps:
                assert_parity(m, prompt, c)


def test_random_arrivals_stress(make_engine, model):
    """Requests of random sizes arriving while others decode, through a small batch."""
    g = torch.Generator().manual_seed(33)
    engine = make_engine(max_batch_size=12)
    futures = []
    for i in range(20):
        prompt = make_prompts(1, 1, 30, seed=100 + i)[0]
        n = int(torch.randint(1, 4, (1,), generator=g))
        sp = SamplingParams(
            n=n,
            max_new_tokens=int(torch.randint(1, 30, (1,), generator=g)),
            temperature=[1.0, 0.0, 0.6][i % 3],
            top_k=[0, 0, 5, 0][i % 4],
        )
        futures.append((prompt, sp, engine.submit(prompt, sp)))
        if i % 3 == 0:
            wait_steps(engine, 1)
    for prompt, sp, fut in futures:
        comps = fut.result(timeout=60)
        assert len(comps) == sp.n
        for c in comps:
            assert 1 <= len(c.token_ids) <= sp.max_new_tokens
            assert c.finish_reason in ("stop", "length")
            assert_parity(model, prompt, c, temperature=sp.temperature)


def test_cache_grows_when_rows_outlive_the_headroom(make_engine, model, monkeypatch):
    from weir.engine import slabs

    monkeypatch.setattr(slabs.Rows, "remaining", lambda self: 0)
    engine = make_engine(eos_token_ids=[])
    prompts = make_prompts(3, 4, 9, seed=34)
    results = engine.generate_many(prompts, SamplingParams(n=2, max_new_tokens=25))
    for prompt, comps in zip(prompts, results, strict=True):
        for c in comps:
            assert len(c.token_ids) == 25
            assert_parity(model, prompt, c)
