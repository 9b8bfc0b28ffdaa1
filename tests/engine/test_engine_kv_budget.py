"""The engine's KV memory: a budget admission respects, geometric slab growth, idle release, sleep/wake.

Byte counts are worked out here from the model config (2 x layers x kv_heads x head_dim x 4 bytes per
token of each sequence for float32), independently of the engine's own arithmetic; the engine's
high-water mark comes from its meter, which counts tensors until they are really collected.
"""

from __future__ import annotations

import time
import weakref

import pytest
import torch
from engine_helpers import assert_parity, make_prompts, ref_logprobs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weir.engine import SamplingParams
from weir.engine.kv_budget import KVBudgetError

MAX_SEQ = 128


def cell(model) -> int:
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4


def alone_need(model, prompt_len: int, n: int, max_new: int) -> int:
    """Bytes one request needs on an empty engine: its prefill row, then n rows of prompt plus
    max_new - 1 columns, plus scratch for moving one slab (1 / (2 x layers) of the slabs)."""
    rows = n * (prompt_len + max_new - 1)
    return cell(model) * (prompt_len + rows + rows / (2 * model.config.num_hidden_layers))


def ids(results):
    return [[c.token_ids for c in r] for r in results]


def wait_for(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.002)


def settle(engine, steps: int) -> None:
    """Let the engine run `steps` more decode steps, or until it has nothing left to do."""
    target = engine.stats()["decode_steps"] + steps

    def done():
        s = engine.stats()
        return s["decode_steps"] >= target or (not s["running_rows"] and not s["waiting_requests"])

    wait_for(done)


request = st.tuples(
    st.integers(1, 14),  # prompt length
    st.integers(1, 3),  # n
    st.integers(1, 12),  # max_new_tokens
    st.integers(0, 2**31),  # seed
)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    reqs=st.lists(request, min_size=1, max_size=10),
    chunks=st.lists(st.integers(1, 4), min_size=10, max_size=10),
    gaps=st.lists(st.integers(0, 3), min_size=10, max_size=10),
    slack=st.floats(1.0, 2.5),
)
def test_admission_never_exceeds_the_budget_and_every_request_completes(
    make_engine, base_model, reqs, chunks, gaps, slack
):
    full = make_prompts(len(reqs), 14, 14, seed=len(reqs))
    prompts = [p[:length] for p, (length, *_rest) in zip(full, reqs, strict=True)]
    params = [SamplingParams(n=n, max_new_tokens=m, temperature=1.0, seed=s) for _, n, m, s in reqs]
    budget = slack * max(
        alone_need(base_model, len(p), sp.n, sp.max_new_tokens)
        for p, sp in zip(prompts, params, strict=True)
    )
    free = make_engine(base_model, max_seq_len=MAX_SEQ)
    expected = ids(free.generate_many(prompts, params))
    free.close()

    eng = make_engine(base_model, max_seq_len=MAX_SEQ, kv_budget_gb=budget / 1024**3)
    futures, i = [], 0
    for size, gap in zip(chunks, gaps, strict=True):  # arrival: chunks, some mid-flight
        if i >= len(prompts):
            break
        futures += eng.submit_many(prompts[i : i + size], params[i : i + size])
        i += size
        settle(eng, gap)
    got = ids(f.result(timeout=60) for f in futures)
    assert got == expected
    stats = eng.kv_stats()
    assert 0 < stats["kv_peak_bytes"] <= int(budget)


def test_the_budget_binds_outputs_unchanged_and_requests_wait(make_engine, base_model):
    prompts = make_prompts(12, 4, 20, seed=5)
    sp = SamplingParams(n=2, max_new_tokens=24, temperature=1.0, seed=11)
    free = make_engine(base_model)
    expected = ids(free.generate_many(prompts, sp))
    unbounded_peak = free.kv_stats()["kv_peak_bytes"]
    free.close()
    budget = alone_need(base_model, 20, 2, 24) * 2.5
    assert unbounded_peak > budget  # all 12 admitted at once would not fit
    eng = make_engine(base_model, kv_budget_gb=budget / 1024**3)
    futures = eng.submit_many(prompts, sp)
    wait_for(lambda: eng.stats()["decode_steps"] > 0)
    assert eng.stats()["waiting_requests"] > 0  # held back, not admitted
    assert ids(f.result(timeout=60) for f in futures) == expected
    assert eng.kv_stats()["kv_peak_bytes"] <= budget


def test_a_request_that_can_never_fit_fails_clearly_and_the_rest_run(make_engine, base_model):
    budget = alone_need(base_model, 10, 1, 8) * 1.5
    eng = make_engine(base_model, kv_budget_gb=budget / 1024**3)
    prompt = make_prompts(1, 10, 10, seed=1)[0]
    big = eng.submit(prompt, SamplingParams(n=8, max_new_tokens=60))
    small = eng.submit(prompt, SamplingParams(n=1, max_new_tokens=8, temperature=0.0))
    with pytest.raises(KVBudgetError, match=r"n=8 .*engine.kv_budget_gb"):
        big.result(timeout=30)
    assert len(small.result(timeout=30)[0].token_ids) == 8


def test_capacity_grows_geometrically_over_many_admissions(make_engine, base_model):
    eng = make_engine(base_model, max_seq_len=512)
    prompts = make_prompts(48, 2, 40, seed=3)
    futures = []
    for i, p in enumerate(prompts):  # one arrival per decode step, limits growing slowly
        futures.append(eng.submit(p, SamplingParams(n=1 + i % 3, max_new_tokens=20 + i)))
        settle(eng, 1)
    for f in futures:
        f.result(timeout=60)
    s = eng.kv_stats()
    # Rows grow to <= 3 * 48 and columns to <= 512: doubling needs at most ~log2 of each.
    assert s["kv_reallocs"] <= 16, s
    assert s["kv_reallocs"] + s["kv_moves"] < len(prompts) / 2, s


def test_idle_engine_gives_its_kv_memory_back(make_engine, base_model):
    eng = make_engine(base_model, kv_idle_release_s=0.05)
    prompts = make_prompts(3, 5, 9, seed=2)
    sp = SamplingParams(n=2, max_new_tokens=6, temperature=0.0)
    first = ids(eng.generate_many(prompts, sp))
    wait_for(lambda: eng.kv_stats()["kv_bytes"] == 0, timeout=5)
    assert eng.kv_stats()["kv_releases"] >= 1
    assert ids(eng.generate_many(prompts, sp)) == first


def test_without_idle_release_the_slabs_stay_for_reuse(make_engine, base_model):
    eng = make_engine(base_model)
    eng.generate_many(make_prompts(2, 5, 9, seed=2), SamplingParams(max_new_tokens=4))
    time.sleep(0.1)
    assert eng.kv_stats()["kv_bytes"] > 0


def _slab_refs(eng):
    cache = eng._batch.cache
    return [weakref.ref(t) for layer in cache.layers for t in (layer.keys, layer.values)]


def test_sleep_frees_kv_and_weights_and_wake_restores_identical_outputs(make_engine, model):
    eng = make_engine(model)
    prompts = make_prompts(4, 3, 12, seed=8)
    sp = SamplingParams(n=3, max_new_tokens=10, temperature=1.0, seed=99)
    before = eng.generate_many(prompts, sp)
    refs = _slab_refs(eng)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert eng.kv_stats()["kv_bytes"] > 0

    eng.sleep_sync(offload_weights=True)
    assert eng.kv_stats()["kv_bytes"] == 0
    assert all(r() is None for r in refs)  # the slab tensors are gone, not just unreferenced here
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    fut = eng.submit(prompts[0], sp)  # waits while asleep
    time.sleep(0.1)
    assert not fut.done()
    with pytest.raises(RuntimeError, match="wake it first"):
        eng.update_weights_sync([], version=1)

    eng.wake_sync()
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n])
    assert ids([fut.result(timeout=30)]) == ids(before[:1])
    after = eng.generate_many(prompts, sp)
    assert ids(after) == ids(before)
    assert [[c.logprobs for c in r] for r in after] == [[c.logprobs for c in r] for r in before]


def test_sleep_with_requests_in_flight_rebuilds_their_kv_on_wake(make_engine, model):
    eng = make_engine(model)
    prompts = make_prompts(3, 4, 10, seed=4)
    sp = SamplingParams(n=2, max_new_tokens=30, temperature=1.0, seed=5)
    futures = eng.submit_many(prompts, sp)
    wait_for(lambda: eng.stats()["decode_steps"] >= 4)
    eng.sleep_sync()
    steps = eng.stats()["decode_steps"]
    assert eng.kv_stats()["kv_bytes"] == 0
    time.sleep(0.1)
    assert eng.stats()["decode_steps"] == steps  # nothing decodes while asleep
    eng.wake_sync()
    for prompt, fut in zip(prompts, futures, strict=True):
        for completion in fut.result(timeout=30):
            assert_parity(model, prompt, completion)


def test_weight_update_mid_flight_under_a_budget(make_engine, model):
    budget = alone_need(model, 12, 2, 30) * 3
    eng = make_engine(model, kv_budget_gb=budget / 1024**3)
    prompts = make_prompts(6, 4, 12, seed=6)
    futures = eng.submit_many(prompts, SamplingParams(n=2, max_new_tokens=30, seed=1))
    wait_for(lambda: eng.stats()["decode_steps"] >= 3)
    with torch.no_grad():
        new = {n: p + 0.01 * torch.randn_like(p) for n, p in model.named_parameters()}
    eng.update_weights_sync(new.items(), version=1)
    after = 0
    for prompt, fut in zip(prompts, futures, strict=True):
        for c in fut.result(timeout=60):
            later = [i for i, v in enumerate(c.versions) if v == 1]
            if later:  # tokens after the update: exactly the new policy's, on the full context
                k, after = later[0], after + 1
                ref = ref_logprobs(model, prompt + c.token_ids[:k], c.token_ids[k:])
                assert torch.allclose(ref, torch.tensor(c.logprobs[k:]), atol=1e-5)
    assert after > 0
    assert eng.kv_stats()["kv_peak_bytes"] <= budget


def test_closing_an_engine_asleep_gives_the_model_its_weights_back(make_engine, model):
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    eng = make_engine(model)
    eng.sleep_sync(offload_weights=True)
    eng.close()
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n])
