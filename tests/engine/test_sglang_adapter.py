"""The SGLang adapter and the server engine under it, against a stand-in server written from SGLang's
documented HTTP API (tests/engine/sglang_standin.py). NOT a live SGLang server: SGLang does not run on
this CPU (docs/engines.md). What these tests establish is weir's side: the requests it sends, how it
reads the stream, versions across a weight update, pause / abort, sleep, routing and retries."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from sglang_standin import StandIn

from weir.config.schema import EngineConfig
from weir.engine.base import SamplingParams
from weir.engine.server_engine import ServerEngine
from weir.engine.servers import Replica, ServerProcess, free_port
from weir.engine.sglang_engine import SglangBackend, start_sglang

EOS = 999


@pytest.fixture
def standin():
    s = StandIn(delay_s=0.0)
    yield s
    s.close()


def make(tmp_path, *urls, **kw):
    cfg = EngineConfig(type="sglang", urls=list(urls), max_model_len=4096, **kw)
    return start_sglang(
        cfg, str(tmp_path), tmp_path / "engine", eos_token_ids=[EOS], dtype="float32", seed=0
    )


def wait_tokens(engine, k: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats()["generated_tokens"] < k:
        assert time.monotonic() < deadline, "no tokens arrived"
        time.sleep(0.005)


def generate_bg(engine, prompt, params):
    out: dict = {}

    def run():
        try:
            out["result"] = engine.generate_many([prompt], params)[0]
        except BaseException as err:  # surfaced by the test
            out["error"] = err

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_requests_and_completions_follow_the_documented_schema(standin, tmp_path):
    engine = make(tmp_path, standin.url)
    try:
        [got] = engine.generate_many(
            [[5]], SamplingParams(n=3, temperature=1.0, max_new_tokens=4, seed=7)
        )
        assert [c.token_ids for c in got] == [[6, 7, 8, 9]] * 3
        assert [c.logprobs for c in got] == [[-0.1] * 4] * 3
        assert [c.versions for c in got] == [[0] * 4] * 3
        assert {c.finish_reason for c in got} == {"length"}
        gens = [b for path, b in standin.requests if path == "/generate"]
        assert len(gens) == 3
        for b in gens:
            assert b["input_ids"] == [5] and b["stream"] is True and b["return_logprob"] is True
            sp = b["sampling_params"]
            assert sp["max_new_tokens"] == 4 and sp["stop_token_ids"] == [EOS] and sp["top_k"] == -1
            assert sp["no_stop_trim"] is True and sp["temperature"] == 1.0
        assert (
            len({b["sampling_params"]["sampling_seed"] for b in gens}) == 3
        )  # one stream per sample
        # a stop id ends the sample and is kept, with its log-prob and version
        [[c]] = engine.generate_many([[5]], SamplingParams(max_new_tokens=10, stop_token_ids=[8]))
        assert (c.token_ids, c.finish_reason, len(c.logprobs)) == ([6, 7, 8], "stop", 3)
        with pytest.raises(ValueError, match="top_p"):
            engine.generate_many([[5]], SamplingParams(top_p=0.9))
    finally:
        engine.close()


def test_update_mid_generation_continues_with_new_version(standin, tmp_path):
    standin.delay_s = 0.01
    engine = make(tmp_path, standin.url)
    try:
        t, out = generate_bg(engine, [100], SamplingParams(max_new_tokens=60))
        wait_tokens(engine, 5)
        engine.update_weights_sync([("step", torch.tensor(3))], version=1)
        t.join(30)
        [c] = out["result"]
        k = c.versions.index(1)
        assert 5 <= k < 60 and c.versions == [0] * k + [1] * (60 - k)
        expect, last = [], 100
        for i in range(60):
            last = (last + (1 if i < k else 3)) % 1000
            expect.append(last)
        assert c.token_ids == expect  # nothing lost, nothing twice
        assert c.logprobs == [-0.1] * k + [-0.3] * (60 - k)
        gens = [b for path, b in standin.requests if path == "/generate"]
        assert gens[-1]["input_ids"] == [100] + expect[:k]  # resubmitted with the tokens so far
        assert gens[-1]["sampling_params"]["max_new_tokens"] == 60 - k
        assert standin.flushes == 1 and engine.version == 1
    finally:
        engine.close()


def test_pause_holds_and_abort_keeps_tokens(standin, tmp_path):
    standin.delay_s = 0.01
    engine = make(tmp_path, standin.url)
    try:
        t, out = generate_bg(engine, [1], SamplingParams(max_new_tokens=500))
        wait_tokens(engine, 3)
        engine.pause_sync()
        held = engine.stats()["generated_tokens"]
        time.sleep(0.2)
        assert engine.stats()["generated_tokens"] == held  # nothing decodes while paused
        engine.resume_sync()
        wait_tokens(engine, held + 3)
        engine.abort_sync()
        t.join(10)
        [c] = out["result"]
        assert c.finish_reason == "abort" and held + 3 <= len(c.token_ids) < 500
        assert c.token_ids == [(1 + i + 1) % 1000 for i in range(len(c.token_ids))]
        # after an abort the engine serves new requests normally
        [[d]] = engine.generate_many([[1]], SamplingParams(max_new_tokens=3))
        assert d.token_ids == [2, 3, 4] and d.finish_reason == "length"
    finally:
        engine.close()


def test_drain_lets_requests_in_flight_finish_and_holds_new_ones(standin, tmp_path):
    """loop.on_weight_update=finish through a server engine: the update waits for the response in
    flight, which is one version's; a request sent during the drain is sent to the server only after
    the update and `resume_sync`, under the new version."""
    standin.delay_s = 0.01
    engine = make(tmp_path, standin.url)
    try:
        t, out = generate_bg(engine, [100], SamplingParams(max_new_tokens=30))
        wait_tokens(engine, 3)
        engine.drain_sync()
        assert engine.stats()["generated_tokens"] == 30  # returned once the response was complete
        t.join(10)
        [c] = out["result"]
        assert c.versions == [0] * 30 and c.logprobs == [-0.1] * 30
        sent = len(standin.requests)
        t2, out2 = generate_bg(engine, [200], SamplingParams(max_new_tokens=4))
        time.sleep(0.2)
        assert len(standin.requests) == sent and "result" not in out2  # held
        engine.update_weights_sync([("step", torch.tensor(3))], version=1)
        engine.resume_sync()
        t2.join(30)
        [d] = out2["result"]
        assert d.versions == [1] * 4 and d.logprobs == [-0.3] * 4
        engine.pause_sync()
        with pytest.raises(RuntimeError, match="paused or asleep"):
            engine.drain_sync()
        engine.resume_sync()
    finally:
        engine.close()


def test_a_drain_that_times_out_returns_false_and_the_response_goes_on(standin, tmp_path):
    """loop.finish_timeout_s through a server engine: `drain_sync(timeout)` gives up while the
    response is still streaming, which then completes; with nothing in flight it returns True."""
    standin.delay_s = 0.01
    engine = make(tmp_path, standin.url)
    try:
        t, out = generate_bg(engine, [100], SamplingParams(max_new_tokens=60))
        wait_tokens(engine, 3)
        t0 = time.perf_counter()
        assert engine.drain_sync(timeout=0.05) is False
        assert time.perf_counter() - t0 >= 0.05 and "result" not in out
        engine.resume_sync()
        t.join(30)
        [c] = out["result"]
        assert len(c.token_ids) == 60
        assert engine.drain_sync(timeout=1.0) is True
        engine.resume_sync()
    finally:
        engine.close()


def test_sleep_releases_memory_and_wakes(standin, tmp_path):
    engine = make(tmp_path, standin.url, sleep_mode=True)
    engine.sleep_mode = True
    try:
        with engine.asleep():
            assert standin.released
            engine.update_weights_sync([("step", torch.tensor(2))], version=1)  # while asleep
            assert standin.released
        assert not standin.released
        [[c]] = engine.generate_many([[0]], SamplingParams(max_new_tokens=2))
        assert c.token_ids == [2, 4] and c.versions == [1, 1]
    finally:
        engine.close()


def test_router_spreads_groups_and_retries_a_dead_replica(tmp_path):
    a, b = StandIn(delay_s=0.01), StandIn(delay_s=0.01)
    engine = make(tmp_path, a.url, b.url)
    try:
        t, out = generate_bg(engine, [10], SamplingParams(n=2, max_new_tokens=50))
        wait_tokens(engine, 4)
        [[first]] = engine.generate_many([[7]], SamplingParams(max_new_tokens=2))
        a_gens = [x for p, x in a.requests if p == "/generate"]
        b_gens = [x for p, x in b.requests if p == "/generate"]
        assert (
            len(a_gens) == 2 and len(b_gens) == 1
        )  # the busy replica's group stays; the next goes to b
        a.close()  # replica 0 dies with the group in flight
        t.join(30)
        got = out["result"]
        assert [c.token_ids for c in got] == [[(10 + i + 1) % 1000 for i in range(50)]] * 2
        assert engine.retries >= 1 and engine.healthy == [False, True]
        assert first.token_ids == [8, 9]
    finally:
        engine.close()
        b.close()


def test_an_owned_server_that_dies_between_requests_is_restarted_at_once_with_current_weights(
    tmp_path,
):
    """The stand-in runs as a process weir owns. It is killed while no request is on it: the
    engine's watcher must restart it and load the current weights before any request is sent."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    script = Path(__file__).with_name("sglang_standin.py")
    proc = ServerProcess(
        argv=[sys.executable, str(script), str(port)],
        url=url,
        log_path=tmp_path / "standin.log",
        startup_timeout_s=60,
    )
    proc.start()
    proc.wait_ready()
    engine = ServerEngine(
        SglangBackend(),
        [Replica(url, proc)],
        eos_token_ids=[EOS],
        max_model_len=4096,
        weights_dir=tmp_path / "weights",
        watch_s=0.2,
    )
    try:
        engine.update_weights_sync([("step", torch.tensor(3))], version=1)
        [[c]] = engine.generate_many([[100]], SamplingParams(max_new_tokens=3))
        assert c.token_ids == [103, 106, 109]
        first_pid, requests = proc.pid, engine.stats()["requests"]
        os.killpg(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while engine.restarts < 1:
            assert time.monotonic() < deadline, "the dead server was not restarted"
            time.sleep(0.05)
        assert engine.stats()["requests"] == requests  # noticed without a request
        assert engine.healthy == [True] and proc.alive() and proc.pid != first_pid
        assert proc.starts == 2
        [[c]] = engine.generate_many([[100]], SamplingParams(max_new_tokens=3))
        assert c.token_ids == [103, 106, 109] and c.versions == [1, 1, 1]  # the weights of v1
        assert engine.retries == 0  # no request met the dead server
    finally:
        engine.close()
    assert not proc.alive()
