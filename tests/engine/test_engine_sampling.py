"""Sampling: greedy, top-k, top-p, temperature, the sampler's distribution, and seeds."""

from __future__ import annotations

import math

import torch
from engine_helpers import (
    assert_parity,
    full_logits,
    greedy_reference,
    make_prompts,
    wait_steps,
)

from weir.engine import SamplingParams
from weir.engine.streams import _mix32_t, mix32, sample_key, stream_uniform


def test_temperature_zero_is_argmax(engine, model):
    prompts = make_prompts(4, 3, 20, seed=10)
    results = engine.generate_many(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for prompt, (c,) in zip(prompts, results, strict=True):
        assert c.token_ids == greedy_reference(model, prompt, 12)
        assert_parity(model, prompt, c, temperature=0.0)  # raw log-probs (T = 1)


def test_greedy_rows_mixed_with_sampled_rows(engine, model):
    prompts = make_prompts(4, 5, 12, seed=11)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 1.0, max_new_tokens=10) for i in range(4)
    ]
    results = engine.generate_many(prompts, params)
    for prompt, sp, (c,) in zip(prompts, params, results, strict=True):
        if sp.temperature == 0.0:
            assert c.token_ids == greedy_reference(model, prompt, 10)
        assert_parity(model, prompt, c, temperature=sp.temperature)


def test_top_k_1_equals_greedy(engine, model):
    prompts = make_prompts(3, 4, 16, seed=12)
    results = engine.generate_many(
        prompts, SamplingParams(top_k=1, temperature=1.3, max_new_tokens=10)
    )
    for prompt, (c,) in zip(prompts, results, strict=True):
        assert c.token_ids == greedy_reference(model, prompt, 10)


def test_top_k_limits_the_support_not_the_logprob(engine, model):
    prompts = make_prompts(3, 4, 16, seed=13)
    params = SamplingParams(n=6, top_k=3, temperature=1.5, max_new_tokens=12)
    results = engine.generate_many(prompts, params)
    for prompt, comps in zip(prompts, results, strict=True):
        for c in comps:
            logits = full_logits(model, prompt, c.token_ids)
            top3 = logits.topk(3, dim=-1).indices
            for t, tok in enumerate(c.token_ids):
                assert tok in top3[t].tolist(), f"token {tok} at step {t} is not in the top 3"
            # The reported log-prob is over the full vocabulary at temperature T.
            assert_parity(model, prompt, c, temperature=1.5)


def test_top_p_keeps_the_nucleus(engine, model):
    prompts = make_prompts(3, 4, 16, seed=14)
    params = SamplingParams(n=6, top_p=0.5, temperature=0.8, max_new_tokens=12)
    results = engine.generate_many(prompts, params)
    for prompt, comps in zip(prompts, results, strict=True):
        for c in comps:
            probs = torch.softmax(full_logits(model, prompt, c.token_ids) / 0.8, -1)
            for t, tok in enumerate(c.token_ids):
                mass_before = probs[t][probs[t] > probs[t, tok]].sum().item()
                assert mass_before < 0.5 + 1e-5
            assert_parity(model, prompt, c, temperature=0.8)


def _first_token_counts(engine, prompt, params) -> torch.Tensor:
    (comps,) = engine.generate_many([prompt], params)
    toks = torch.tensor([c.token_ids[0] for c in comps])
    return torch.bincount(toks, minlength=262).double()


def _assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    n = counts.sum()
    expected = probs.double() * n
    sd = (n * probs.double() * (1 - probs.double())).sqrt()
    assert torch.all(counts[expected == 0] == 0), "sampled a token of probability 0"
    z = ((counts - expected).abs() / sd.clamp(min=1e-9))[expected > 0]
    assert z.max() < 5.0, f"empirical distribution is off (max z {z.max():.1f})"


def test_sampler_draws_from_the_softmax(engine, model):
    """Many first tokens of one prompt (max_new_tokens=1: rows end at the prefill)."""
    prompt = make_prompts(1, 10, 10, seed=15)[0]
    logits = full_logits(model, prompt, [0])[0]
    counts = _first_token_counts(
        engine, prompt, SamplingParams(n=4000, temperature=0.5, max_new_tokens=1, seed=3)
    )
    _assert_matches(counts, torch.softmax(logits / 0.5, -1))

    counts = _first_token_counts(
        engine, prompt, SamplingParams(n=4000, temperature=1.0, top_k=4, max_new_tokens=1, seed=4)
    )
    masked = torch.full_like(logits, -math.inf)
    top = logits.topk(4).indices
    masked[top] = logits[top]
    _assert_matches(counts, torch.softmax(masked, -1))

    counts = _first_token_counts(
        engine, prompt, SamplingParams(n=4000, temperature=1.0, top_p=0.3, max_new_tokens=1, seed=5)
    )
    probs = torch.softmax(logits, -1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    nucleus = torch.zeros_like(probs)
    keep = order[before < 0.3]
    nucleus[keep] = probs[keep]
    _assert_matches(counts, nucleus / nucleus.sum())


def test_seed_reproducible_regardless_of_batching(engine, model):
    prompt = make_prompts(1, 9, 9, seed=16)[0]
    others = make_prompts(5, 3, 25, seed=17)
    seeded = [
        SamplingParams(n=3, max_new_tokens=16, seed=123),
        SamplingParams(n=2, max_new_tokens=16, seed=7, top_k=5, temperature=0.9),
    ]
    for sp in seeded:
        alone = engine.submit(prompt, sp).result(timeout=30)
        # Batched with others (some filtered, some greedy) submitted in the same call.
        mixed = [
            SamplingParams(n=2, max_new_tokens=20, top_p=0.9 if i % 2 else 1.0) for i in range(5)
        ]
        batched = engine.submit_many(
            others[:2] + [prompt] + others[2:], mixed[:2] + [sp] + mixed[2:]
        )
        together = batched[2].result(timeout=30)
        # Joining mid-flight.
        running = engine.submit_many(others, SamplingParams(n=3, max_new_tokens=30))
        wait_steps(engine, 3)
        late = engine.submit(prompt, sp).result(timeout=30)
        for f in running + batched:
            f.result(timeout=30)
        ids = [[c.token_ids for c in r] for r in (alone, together, late)]
        assert ids[0] == ids[1] == ids[2]
        assert len({tuple(t) for t in ids[0]}) == len(ids[0]), "samples of one request differ"
        for r in (alone, together, late):
            for c in r:
                assert_parity(model, prompt, c, temperature=sp.temperature)

    a = engine.submit(prompt, SamplingParams(n=2, max_new_tokens=16, seed=1)).result(timeout=30)
    b = engine.submit(prompt, SamplingParams(n=2, max_new_tokens=16, seed=2)).result(timeout=30)
    assert [c.token_ids for c in a] != [c.token_ids for c in b]


def test_engine_seed_makes_unseeded_requests_reproducible(make_engine, base_model):
    import copy

    prompts = make_prompts(4, 3, 10, seed=18)
    runs = []
    for _ in range(2):
        engine = make_engine(copy.deepcopy(base_model), seed=42)
        runs.append(engine.generate_many(prompts, SamplingParams(n=2, max_new_tokens=10)))
    assert [[c.token_ids for c in r] for r in runs[0]] == [
        [c.token_ids for c in r] for r in runs[1]
    ]


def test_counter_rng_matches_python_and_is_uniform():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2**32, (1000,), dtype=torch.long, generator=g)
    x = torch.cat([x, torch.tensor([0, 1, 2**31, 2**32 - 1])])
    assert _mix32_t(x.clone()).tolist() == [mix32(v) for v in x.tolist()]

    keys = torch.tensor([sample_key(s, i) for s in range(50) for i in range(4)])
    assert len(set(keys.tolist())) == len(keys)
    u = torch.cat([stream_uniform(keys, torch.full_like(keys, t)) for t in range(200)])
    assert u.min() > 0.0 and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01
    hist = torch.histc(u, bins=16, min=0.0, max=1.0)
    expected = u.numel() / 16
    chi2 = ((hist - expected) ** 2 / expected).sum().item()
    assert chi2 < 45.0  # 15 degrees of freedom; p ~ 1e-4
