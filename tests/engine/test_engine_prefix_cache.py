"""Cross-turn KV reuse (`weir.engine.prefix_cache`): a turn that continues a cached conversation
prefills only its new tokens, and samples exactly what a fresh prefill of the whole conversation
samples (same tokens for the same seed, log-probs within 1e-5 of a plain full forward)."""

from __future__ import annotations

import copy

import torch
from engine_helpers import TOL, assert_parity, make_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.engine import SamplingParams
from weir.engine.kv_budget import KVMeter
from weir.engine.prefix_cache import PrefixCache

STOPS = list(range(6, 40))  # ~13% of the vocabulary: random-model turns end within a few tokens


def turn_params(turn: int, i: int, keep_kv: bool = True, n: int = 1) -> SamplingParams:
    return SamplingParams(
        n=n,
        max_new_tokens=12,
        seed=1000 * turn + i,
        stop_token_ids=STOPS,
        keep_kv=keep_kv,
    )


def play(engine, prompts, observations, turns: int, n: int = 1):
    """Episodes of `turns` model turns: conversation += completion + observation. Returns every
    turn's (conversation, completions) per episode; an episode whose turn did not stop ends."""
    convs = [list(p) for p in prompts]
    alive = list(range(len(convs)))
    played = []
    for turn in range(turns):
        params = [turn_params(turn, i, n=n) for i in alive]
        results = engine.generate_many([convs[i] for i in alive], params)
        played.append([(list(convs[i]), r) for i, r in zip(alive, results, strict=True)])
        nxt = []
        for i, comps in zip(alive, results, strict=True):
            if comps[0].finish_reason == "stop":
                convs[i] += comps[0].token_ids + observations[i]
                nxt.append(i)
        alive = nxt
    return played


def test_reused_kv_samples_exactly_what_a_fresh_prefill_samples(make_engine, model):
    cached = make_engine()
    fresh = make_engine(copy.deepcopy(model), prefix_cache=False)
    prompts = make_prompts(6, 5, 30, seed=1)
    observations = make_prompts(6, 1, 12, seed=2)
    got = play(cached, prompts, observations, turns=4)
    want = play(fresh, prompts, observations, turns=4)
    assert len(got) == len(want) == 4
    later_turns = 0
    for turn_got, turn_want in zip(got, want, strict=True):
        assert [c for c, _ in turn_got] == [c for c, _ in turn_want]
        for (conv, (g,)), (_, (w,)) in zip(turn_got, turn_want, strict=True):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
            assert (torch.tensor(g.logprobs) - torch.tensor(w.logprobs)).abs().max() <= TOL
            assert_parity(model, conv, g)
        later_turns += len(turn_got) if turn_got is not got[0] else 0
    st_c, st_f = cached.stats(), fresh.stats()
    assert later_turns > 0 and st_c["prefix_hits"] == later_turns  # every continuation hit
    # What was not prefilled is exactly what was reused.
    assert st_c["prefill_tokens"] + st_c["prefix_reused_tokens"] == st_f["prefill_tokens"]
    assert st_c["prefix_reused_tokens"] > st_c["prefill_tokens"] - sum(len(p) for p in prompts)


def test_each_of_n_samples_continues_its_own_cached_turn(make_engine, model):
    engine = make_engine()
    prompt = make_prompts(1, 10, 10, seed=3)[0]
    first = engine.submit(prompt, turn_params(0, 0, n=4)).result(timeout=30)
    stopped = [c for c in first if c.finish_reason == "stop"]
    assert len(stopped) >= 2 and engine.stats()["prefix_entries"] == len(stopped)
    obs = [7, 8, 9]
    convs = [prompt + c.token_ids + obs for c in stopped]
    results = engine.generate_many(convs, [turn_params(1, i) for i in range(len(convs))])
    assert engine.stats()["prefix_hits"] == len(stopped)
    for conv, (c,) in zip(convs, results, strict=True):
        assert_parity(model, conv, c)


def test_hits_and_misses_admitted_together(make_engine, model):
    engine = make_engine()
    prompt = make_prompts(1, 8, 8, seed=4)[0]
    (c,) = engine.submit(prompt, turn_params(0, 0)).result(timeout=30)
    assert c.finish_reason == "stop"
    hit = prompt + c.token_ids + [11, 12]
    misses = make_prompts(3, 3, 40, seed=5)  # one longer than the hit, some shorter
    convs = [misses[0], hit, *misses[1:]]
    results = engine.generate_many(convs, [turn_params(1, i) for i in range(len(convs))])
    stats = engine.stats()
    assert stats["prefix_hits"] == 1 and stats["prefix_misses"] == 3
    assert stats["prefix_reused_tokens"] == len(prompt) + len(c.token_ids) - 1
    for conv, (comp,) in zip(convs, results, strict=True):
        assert_parity(model, conv, comp)


def test_a_weight_update_drops_the_cached_kv(make_engine, model):
    engine = make_engine()
    prompt = make_prompts(1, 12, 12, seed=6)[0]
    (c,) = engine.submit(prompt, turn_params(0, 0)).result(timeout=30)
    assert c.finish_reason == "stop" and engine.stats()["prefix_entries"] == 1
    with torch.no_grad():
        new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    engine.update_weights_sync(new.items(), version=1)
    assert engine.stats()["prefix_entries"] == 0
    conv = prompt + c.token_ids + [9, 10]
    before = engine.stats()["prefill_tokens"]
    (c2,) = engine.submit(conv, turn_params(1, 0)).result(timeout=30)
    assert engine.stats()["prefill_tokens"] - before == len(conv)  # prefilled afresh
    assert engine.stats()["prefix_hits"] == 0
    assert_parity(model, conv, c2)  # `model` holds the new weights (updated in place)
    assert c2.versions == [1] * len(c2.token_ids)


def test_requests_without_keep_kv_leave_nothing_behind(make_engine):
    engine = make_engine()
    prompts = make_prompts(4, 5, 20, seed=7)
    engine.generate_many(prompts, [turn_params(0, i, keep_kv=False) for i in range(4)])
    stats = engine.stats()
    assert stats["prefix_stored"] == 0 and stats["prefix_entries"] == 0
    assert stats["prefix_misses"] == 0  # nothing cached: no lookup either


def test_cached_kv_counts_against_the_budget_and_gives_way(make_engine, model):
    """Entries are in the KV meter; a request that needs their room evicts them instead of waiting
    forever or being refused."""
    probe = make_engine(copy.deepcopy(model))
    cell = probe._kv.cell
    prompt_len, max_new = 40, 12
    need = probe.kv_request_bytes(prompt_len, 1, max_new)
    probe.close()
    engine = make_engine(kv_budget_gb=1.2 * need / 1024**3, kv_idle_release_s=None)
    prompts = make_prompts(3, 8, 8, seed=8)
    results = engine.generate_many(prompts, [turn_params(0, i) for i in range(3)])
    stored = engine.stats()
    assert stored["prefix_entries"] >= 1 and stored["prefix_bytes"] % cell == 0
    assert stored["kv_bytes"] >= stored["prefix_bytes"] > 0
    assert any(c.finish_reason == "stop" for (c,) in results)
    big = make_prompts(1, prompt_len, prompt_len, seed=9)[0]
    (c,) = engine.submit(big, turn_params(1, 0)).result(timeout=60)
    assert engine.stats()["prefix_evicted"] > stored["prefix_evicted"]
    assert engine.stats()["kv_peak_bytes"] <= engine.stats()["kv_budget_bytes"]
    assert_parity(model, big, c)


def test_entries_beyond_the_limit_evict_the_oldest(make_engine):
    engine = make_engine(prefix_cache_entries=2)
    prompt = make_prompts(1, 6, 6, seed=10)[0]
    comps = engine.submit(prompt, turn_params(0, 0, n=8)).result(timeout=30)
    stopped = sum(c.finish_reason == "stop" for c in comps)
    stats = engine.stats()
    assert stats["prefix_entries"] == min(2, stopped)
    assert stats["prefix_evicted"] == max(0, stopped - 2)


# -- the cache itself ----------------------------------------------------------------------------


def _kv(length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.zeros(2, length, 4)], [torch.ones(2, length, 4)]


@settings(max_examples=60, deadline=None)
@given(
    stored=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=8),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=8),
)
def test_take_returns_the_longest_stored_proper_prefix(stored, prompt):
    cache = PrefixCache(KVMeter(), max_entries=100)
    for ids in stored:
        cache.store(ids, *_kv(len(ids)), version=0, budget=None)
    candidates = [ids for ids in stored if len(ids) < len(prompt) and prompt[: len(ids)] == ids]
    # each store of the same ids is one use; each take consumes one use of the longest left
    uses = sorted((tuple(c) for c in candidates), key=len, reverse=True)
    for expected in [*uses, None]:
        entry = cache.take(prompt, version=0)
        assert (entry.ids if entry is not None else None) == expected


def test_other_versions_and_whole_prompts_do_not_match():
    meter = KVMeter()
    cache = PrefixCache(meter, max_entries=4)
    cache.store([1, 2, 3], *_kv(3), version=0, budget=None)
    assert meter.live == 2 * 2 * 3 * 4 * 4
    assert cache.take([1, 2, 3], version=0) is None  # nothing left to compute the next token from
    assert cache.take([1, 2, 3, 4], version=1) is None  # computed by other weights
    assert cache.take([1, 2, 3, 4], version=0) is not None
    cache.store([5], *_kv(1), version=0, budget=None)
    cache.clear()
    assert len(cache) == 0 and meter.live == 0


def test_store_under_a_budget_evicts_older_entries_or_skips():
    meter = KVMeter()
    cache = PrefixCache(meter, max_entries=10)
    per_token = 2 * 2 * 4 * 4  # keys + values, 2 heads x 4 dims, float32
    assert cache.store([1, 2], *_kv(2), version=0, budget=5 * per_token)
    assert cache.store([3, 4], *_kv(2), version=0, budget=5 * per_token)
    assert cache.store([5, 6, 7], *_kv(3), version=0, budget=5 * per_token)  # evicts [1, 2]
    assert len(cache) == 2 and cache.take([1, 2, 0], version=0) is None
    assert not cache.store(list(range(6)), *_kv(6), version=0, budget=5 * per_token)
    assert meter.live <= 5 * per_token


def test_samples_that_end_alike_share_one_entry_and_each_continues():
    meter = KVMeter()
    cache = PrefixCache(meter, max_entries=4)
    for _ in range(3):  # three samples made the same turn
        assert cache.store([1, 2, 3], *_kv(3), version=0, budget=None)
    assert len(cache) == 1 and meter.live == 2 * 2 * 3 * 4 * 4  # one copy
    assert [cache.take([1, 2, 3, 9], version=0) is not None for _ in range(4)] == [
        True,
        True,
        True,
        False,
    ]
