"""Stops and limits, continuous batching, weight updates and versions, pause/abort/close, async use,
and errors."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
import torch
from engine_helpers import (
    assert_parity,
    greedy_reference,
    make_prompts,
    perturbed,
    ref_logprobs,
    wait_steps,
)

from weir.engine import Completion, Engine, SamplingParams, TorchEngine


def test_engine_protocol(engine):
    assert isinstance(engine, Engine)
    assert engine.version == 0


def test_stop_tokens_max_new_tokens_and_finish_reasons(make_engine, model):
    prompt = make_prompts(1, 8, 8, seed=20)[0]
    base = greedy_reference(model, prompt, 20, eos=None)
    engine = make_engine(eos_token_ids=[])  # no EOS: the greedy run goes the full length
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    (c,) = engine.submit(prompt, greedy).result(timeout=30)
    assert c.token_ids == base and c.finish_reason == "length"

    j = next(i for i in range(2, 20) if base[i] not in base[:i])
    sp = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[base[j]])
    (c,) = engine.submit(prompt, sp).result(timeout=30)
    assert c.token_ids == base[: j + 1], "the stop token is included"
    assert c.finish_reason == "stop"
    assert len(c.logprobs) == len(c.versions) == j + 1

    (c,) = engine.submit(prompt, SamplingParams(temperature=0.0, max_new_tokens=5)).result(
        timeout=30
    )
    assert c.token_ids == base[:5] and c.finish_reason == "length"
    (c,) = engine.submit(prompt, SamplingParams(temperature=0.0, max_new_tokens=1)).result(
        timeout=30
    )
    assert c.token_ids == base[:1] and c.finish_reason == "length"
    comps = engine.submit(prompt, SamplingParams(n=2, max_new_tokens=0)).result(timeout=30)
    assert comps == [Completion([], [], [], "length")] * 2

    # An engine-level EOS always stops.
    eos_engine = make_engine(eos_token_ids=[base[j]])
    (c,) = eos_engine.submit(prompt, greedy).result(timeout=30)
    assert c.token_ids == base[: j + 1] and c.finish_reason == "stop"


def test_max_seq_len(make_engine, model):
    engine = make_engine(max_seq_len=16)
    prompt = make_prompts(1, 10, 10, seed=21)[0]
    (c,) = engine.submit(prompt, SamplingParams(max_new_tokens=50, temperature=0.0)).result(
        timeout=30
    )
    assert len(c.token_ids) <= 6
    if c.finish_reason == "length":
        assert len(c.token_ids) == 6
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.submit(list(range(6, 22)), SamplingParams()).result(timeout=30)


def test_request_joining_running_batch_completes_with_the_same_result(engine, model):
    prompt = make_prompts(1, 11, 11, seed=22)[0]
    sp = SamplingParams(n=2, max_new_tokens=15, seed=5)
    alone = engine.submit(prompt, sp).result(timeout=30)
    running = engine.submit_many(
        make_prompts(6, 4, 30, seed=23), SamplingParams(n=4, max_new_tokens=150)
    )
    wait_steps(engine, 5)
    assert engine.stats()["running_rows"] > 0
    joined = engine.submit(prompt, sp).result(timeout=30)
    assert not all(f.done() for f in running), "the late request should finish before the long ones"
    assert [c.token_ids for c in joined] == [c.token_ids for c in alone]
    for c in joined:
        assert_parity(model, prompt, c)
    for f in running:
        f.result(timeout=30)


@pytest.mark.parametrize(
    "engine_kw",
    [{}, {"max_prefill_tokens": 16}, {"recompute_kv_on_update": False}],
    ids=["recompute", "recompute-chunked", "stale-kv"],
)
def test_weight_update_mid_response(make_engine, model, engine_kw):
    engine = make_engine(eos_token_ids=[], **engine_kw)
    old = copy.deepcopy(model)
    prompts = make_prompts(2, 6, 14, seed=24)
    params = SamplingParams(n=2, max_new_tokens=80, seed=9)

    async def run():
        futs = [asyncio.ensure_future(engine.generate(p, params)) for p in prompts]
        await asyncio.to_thread(wait_steps, engine, 6)
        await engine.pause()
        await engine.update_weights(perturbed(model).items(), version=1)
        assert engine.version == 1
        await engine.resume()
        return await asyncio.gather(*futs)

    results = asyncio.run(run())
    new = model  # the engine's model now holds the new weights
    for prompt, comps in zip(prompts, results, strict=True):
        for c in comps:
            assert len(c.token_ids) == 80
            assert c.versions == sorted(c.versions) and set(c.versions) == {0, 1}
            k = c.versions.index(1)
            assert 6 <= k < 80
            # Tokens before the update: old weights; after it: the new weights on the full context.
            ref_old = torch.log_softmax(_logits(old, prompt, c.token_ids), -1)
            ref_new = torch.log_softmax(_logits(new, prompt, c.token_ids), -1)
            toks = torch.tensor(c.token_ids)[:, None]
            got = torch.tensor(c.logprobs)
            assert (ref_old.gather(1, toks).squeeze(1)[:k] - got[:k]).abs().max() < 1e-5
            err_new = (ref_new.gather(1, toks).squeeze(1)[k:] - got[k:]).abs().max()
            if engine_kw.get("recompute_kv_on_update", True):
                assert err_new < 1e-5
            else:  # the earlier tokens' KV still comes from the old weights
                assert err_new > 1e-4


@torch.inference_mode()
def _logits(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    return model(ids).logits[0, len(prompt) - 1 : -1].float()


def test_update_weights_colocated_tensors_only_bump_the_version(engine, model):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.update_weights_sync(model.named_parameters(), version=3)
    assert engine.version == 3
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    with pytest.raises(KeyError, match="no parameter"):
        engine.update_weights_sync([("not.a.weight", torch.zeros(1))], version=4)
    with pytest.raises(ValueError, match="shape"):
        name = next(iter(before))
        engine.update_weights_sync([(name, torch.zeros(1))], version=4)
    assert engine.version == 3
    prompt = make_prompts(1, 5, 5, seed=25)[0]
    (c,) = engine.submit(prompt, SamplingParams(max_new_tokens=4)).result(timeout=30)
    assert set(c.versions) == {3}


def test_abort_returns_partial_completions(make_engine, model):
    engine = make_engine(eos_token_ids=[])
    prompts = make_prompts(3, 4, 10, seed=26)
    futs = engine.submit_many(prompts, SamplingParams(n=2, max_new_tokens=400))
    wait_steps(engine, 5)
    engine.abort_sync()
    for prompt, f in zip(prompts, futs, strict=True):
        comps = f.result(timeout=30)
        for c in comps:
            assert c.finish_reason == "abort"
            assert 5 <= len(c.token_ids) < 400
            assert_parity(model, prompt, c)

    # Waiting requests are aborted too (empty), and the engine keeps serving.
    engine.pause_sync()
    waiting = engine.submit(prompts[0], SamplingParams(n=3, max_new_tokens=4))
    engine.abort_sync()
    assert waiting.result(timeout=30) == [Completion([], [], [], "abort")] * 3
    engine.resume_sync()
    (c,) = engine.submit(prompts[0], SamplingParams(max_new_tokens=4)).result(timeout=30)
    assert len(c.token_ids) == 4 and c.finish_reason == "length"


def test_async_many_in_flight(engine, model):
    prompts = make_prompts(50, 2, 20, seed=27)

    async def run():
        return await asyncio.gather(
            *(engine.generate(p, SamplingParams(n=2, max_new_tokens=8)) for p in prompts)
        )

    results = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert len(results) == 50
    for prompt, comps in zip(prompts, results, strict=True):
        assert len(comps) == 2
        for c in comps:
            assert 1 <= len(c.token_ids) <= 8
        assert_parity(model, prompt, comps[0])


def test_cancelled_request_leaves_the_batch(make_engine):
    engine = make_engine(eos_token_ids=[])
    prompt = make_prompts(1, 6, 6, seed=28)[0]

    async def run():
        task = asyncio.ensure_future(
            engine.generate(prompt, SamplingParams(n=4, max_new_tokens=400))
        )
        await asyncio.to_thread(wait_steps, engine, 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while engine.stats()["running_rows"] and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.stats()["running_rows"] == 0


def test_bad_requests_fail_their_future_only(engine, model):
    prompt = make_prompts(1, 6, 6, seed=29)[0]
    bad = engine.submit([5, 99999], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bad.result(timeout=30)
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], SamplingParams()).result(timeout=30)
    futs = engine.submit_many([prompt, [-3, 7]], SamplingParams(max_new_tokens=3))
    assert len(futs[0].result(timeout=30)[0].token_ids) <= 3
    with pytest.raises(ValueError):
        futs[1].result(timeout=30)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)


def test_errors_in_the_loop_fail_the_affected_futures(make_engine, model):
    poison = 7
    state = {"fail_decode": False}
    forward = model.forward

    def faulty(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is None:  # the reference forward in the checks
            return forward(*args, **kwargs)
        if ids.shape[1] > 1 and bool((ids == poison).any()):
            raise RuntimeError("poisoned prompt")
        if ids.shape[1] == 1 and state["fail_decode"]:
            state["fail_decode"] = False
            raise RuntimeError("decode failure")
        return forward(*args, **kwargs)

    model.forward = faulty
    engine = make_engine()
    good = [p for p in make_prompts(4, 4, 12, seed=30) if poison not in p]
    prompts = good[:2] + [good[2][:2] + [poison] + good[2][2:]]
    futs = engine.submit_many(prompts, SamplingParams(n=2, max_new_tokens=6))
    with pytest.raises(RuntimeError, match="poisoned"):
        futs[2].result(timeout=30)
    for prompt, f in zip(prompts[:2], futs[:2], strict=True):
        for c in f.result(timeout=30):  # isolated from the faulty request
            assert_parity(model, prompt, c)

    running = engine.submit(good[0], SamplingParams(n=2, max_new_tokens=100))
    wait_steps(engine, 2)
    state["fail_decode"] = True
    with pytest.raises(RuntimeError, match="decode failure"):
        running.result(timeout=30)
    (c,) = engine.submit(good[1], SamplingParams(max_new_tokens=5)).result(timeout=30)
    assert_parity(model, good[1], c)


def test_close_aborts_and_stops_the_thread(model):
    engine = TorchEngine(model, eos_token_ids=[], pad_token_id=0)
    fut = engine.submit(make_prompts(1, 5, 5, seed=31)[0], SamplingParams(max_new_tokens=400))
    wait_steps(engine, 2)
    engine.close()
    assert fut.result(timeout=5)[0].finish_reason == "abort"
    assert not engine._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([6, 7], SamplingParams())
    engine.close()  # idempotent
    with TorchEngine(model, eos_token_ids=[1], pad_token_id=0) as eng:
        assert eng.generate_many([[6, 7, 8]], SamplingParams(max_new_tokens=2))[0][0].token_ids
    assert not eng._thread.is_alive()


def test_pause_holds_requests_in_flight_and_resume_continues(make_engine, model):
    engine = make_engine(eos_token_ids=[])
    prompt = make_prompts(1, 7, 7, seed=32)[0]
    running = engine.submit(prompt, SamplingParams(n=2, max_new_tokens=100, seed=4))
    wait_steps(engine, 3)
    engine.pause_sync()
    steps = engine.stats()["decode_steps"]
    waiting = engine.submit(prompt, SamplingParams(max_new_tokens=3))
    time.sleep(0.1)
    assert engine.stats()["decode_steps"] == steps
    assert not running.done() and not waiting.done()
    assert engine.stats()["waiting_requests"] == 1
    engine.resume_sync()
    comps = running.result(timeout=30)
    assert [len(c.token_ids) for c in comps] == [100, 100]
    alone = engine.submit(prompt, SamplingParams(n=2, max_new_tokens=100, seed=4)).result(
        timeout=30
    )
    assert [c.token_ids for c in comps] == [c.token_ids for c in alone]
    assert len(waiting.result(timeout=30)[0].token_ids) == 3


def test_drain_finishes_the_rows_in_flight_under_their_weights_and_holds_new_ones(
    make_engine, model
):
    """`drain_sync` + update + `resume_sync` (loop.on_weight_update=finish): the responses in
    flight end under the weights they started with, every token of them version 0 and the old
    model's log-prob; a request submitted during the drain starts only after the update, wholly
    under the new weights."""
    engine = make_engine(eos_token_ids=[])
    old = copy.deepcopy(model)
    prompts = make_prompts(2, 5, 9, seed=33)
    running = engine.submit_many(prompts, SamplingParams(n=2, max_new_tokens=60, seed=5))
    wait_steps(engine, 4)
    drained = {}

    def drain():
        engine.drain_sync()
        drained["steps"] = engine.stats()["decode_steps"]

    waiter = threading.Thread(target=drain)
    waiter.start()
    time.sleep(0.02)
    late = engine.submit(prompts[0], SamplingParams(max_new_tokens=8, seed=6))
    waiter.join(30)
    assert not waiter.is_alive()
    assert all(f.done() for f in running) and not late.done()  # held, not admitted
    time.sleep(0.05)
    assert engine.stats()["decode_steps"] == drained["steps"]  # nothing ran while held
    assert engine.stats()["waiting_requests"] == 1
    engine.update_weights_sync(perturbed(model).items(), version=1)
    engine.resume_sync()
    (fresh,) = late.result(timeout=30)
    for prompt, f in zip(prompts, running, strict=True):
        for c in f.result():
            assert len(c.token_ids) == 60 and set(c.versions) == {0}
            assert_parity(old, prompt, c)
    assert fresh.versions == [1] * 8
    assert_parity(model, prompts[0], fresh)  # the engine's model holds the new weights
    assert not torch.equal(
        ref_logprobs(old, prompts[0], fresh.token_ids), torch.tensor(fresh.logprobs)
    )
    engine.pause_sync()
    with pytest.raises(RuntimeError, match="paused or asleep"):
        engine.drain_sync()
    engine.resume_sync()


def test_a_drain_that_times_out_leaves_the_rows_running_into_the_new_weights(make_engine, model):
    """`drain_sync(timeout)` (loop.finish_timeout_s): a response longer than the wait is still
    decoding when it returns False; the update then reaches it, as with `continue`, and the
    request held meanwhile starts only after `resume_sync`. With nothing in flight it is True."""
    engine = make_engine(eos_token_ids=[])
    prompt = make_prompts(1, 6, 6, seed=34)[0]
    long = engine.submit(prompt, SamplingParams(n=2, max_new_tokens=400, seed=7))
    wait_steps(engine, 3)
    t0 = time.perf_counter()
    assert engine.drain_sync(timeout=0.05) is False
    assert 0.05 <= time.perf_counter() - t0 < 5 and not long.done()
    late = engine.submit(prompt, SamplingParams(max_new_tokens=4, seed=8))
    engine.update_weights_sync(perturbed(model).items(), version=1)
    time.sleep(0.05)
    assert engine.stats()["waiting_requests"] == 1  # still held: not admitted before resume
    engine.resume_sync()
    for c in long.result(timeout=60):
        assert len(c.token_ids) == 400 and set(c.versions) == {0, 1}
        assert c.versions == sorted(c.versions)
    assert late.result(timeout=30)[0].versions == [1] * 4
    assert engine.drain_sync(timeout=0.05) is True  # nothing in flight
    engine.resume_sync()


def test_a_drain_timeout_also_bounds_the_wait_for_the_step_in_progress(make_engine, model):
    """With decode steps of 0.4 s, `drain_sync(timeout=0.05)` returns False within the timeout
    instead of waiting for the step under way to end (the loop yields to it before its next)."""
    engine = make_engine(eos_token_ids=[])
    step = engine._decode_step

    def slow() -> None:
        time.sleep(0.4)
        step()

    engine._decode_step = slow
    fut = engine.submit([6, 7, 8], SamplingParams(max_new_tokens=50))
    wait_steps(engine, 1)
    time.sleep(0.1)  # the second step is under way
    t0 = time.perf_counter()
    assert engine.drain_sync(timeout=0.05) is False
    assert time.perf_counter() - t0 < 0.3
    engine.resume_sync()
    engine.abort_sync()
    assert fut.result(timeout=30)[0].finish_reason == "abort"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dying_loop_thread_fails_every_caller(make_engine, model):
    forward = model.forward

    def dying(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:
            raise SystemExit("simulated thread death")
        return forward(*args, **kwargs)

    engine = make_engine()  # its start-up forward (measuring the KV cell) must not die
    model.forward = dying
    fut = engine.submit([6, 7, 8], SamplingParams(max_new_tokens=10))
    with pytest.raises(RuntimeError, match="thread died"):
        fut.result(timeout=30)
    engine._thread.join(5)
    assert not engine._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([6, 7], SamplingParams())
