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


class _Now:
    """A Ray actor method's `.remote`, run in a thread of this process (a future stands for the
    object ref)."""

    def __init__(self, pool, fn):
        self.pool, self.fn = pool, fn

    def remote(self, *args):
        return self.pool.submit(self.fn, *args)


class _Rank0:
    """Trainer rank 0 in this process: a state dict streamed bucket by bucket to its group."""

    def __init__(self, pool, state):
        from weir.sync.broadcast import BroadcastGroup, TensorMeta

        self.state, self.group = state, None
        self._BroadcastGroup = BroadcastGroup
        self.layout = _Now(
            pool, lambda dtype, role: [TensorMeta.of(k, v) for k, v in state.items()]
        )
        self.sync_address = _Now(pool, lambda: ("127.0.0.1", free_port()))
        self.join = _Now(pool, self._join)
        self.stream = _Now(pool, self._stream)

    def _join(self, host, port, size, name, backend, style, per_tensor, role):
        self.group = self._BroadcastGroup(
            host, port, 0, size, backend=backend, name=name, style=style, per_tensor=per_tensor
        )

    def _stream(self, buckets, shared, version, role):
        sent = 0
        for bucket in buckets:
            flat = torch.cat([self.state[m.name].reshape(-1) for m in bucket])
            sent += self.group.send_flat(flat, bucket)
        return sent, 0.0  # as `SyncTrainerRank.stream`: (bytes sent, offload seconds)


class _Trainer:
    """What `ServerSync` asks of a `TrainerGroup`, for one rank in this process."""

    def __init__(self, state):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(4)
        self.rank0 = _Rank0(self.pool, state)
        self.trained = 0
        self._collective = threading.RLock()

    def get(self, refs):
        return [r.result(timeout=120) for r in refs]

    def collective(self, submit):
        return self.get([submit(0, self.rank0)])


def test_weights_reach_sglang_over_its_distributed_update_protocol(tmp_path):
    """weir's side of SGLang's `init_weights_update_group` + `update_weights_from_distributed`
    against the stand-in in a process of its own (it joins the group as SGLang does and receives a
    broadcast per tensor): the bodies, one call per bucket in order, the tensors bit for bit, the
    cache flushed after the last bucket, the version moving only when every bucket is in."""
    import json
    import urllib.request

    from weir.sync.server_sync import ServerSync

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    script = Path(__file__).with_name("sglang_standin.py")
    proc = ServerProcess(
        argv=[sys.executable, str(script), str(port)],
        url=url,
        log_path=tmp_path / "standin.log",
        startup_timeout_s=120,
    )
    proc.start()
    proc.wait_ready()
    state = {
        "model.a.weight": torch.arange(12.0).reshape(3, 4),
        "model.b.weight": torch.randn(64, 8),
        "step": torch.tensor([3.0]),
    }
    trainer = _Trainer(state)
    sent: list[tuple[str, dict]] = []

    class Recording(SglangBackend):
        async def _post(self, client, url, path, body=None):
            sent.append((path, body))
            return await super()._post(client, url, path, body)

    engine = ServerEngine(
        Recording(),
        [Replica(url, proc)],
        eos_token_ids=[EOS],
        max_model_len=4096,
        weights_dir=tmp_path / "weights",
        watch_s=0,
    )

    def received() -> dict:
        with urllib.request.urlopen(url + "/received", timeout=30) as r:  # noqa: S310
            return json.loads(r.read())

    try:
        sync = ServerSync(trainer, engine, bucket_mb=1e-3, backend="gloo")  # ~1 KB buckets
        stats = sync.push(1)
        assert stats["sync/mb"] * 2**20 == sum(t.numel() * 4 for t in state.values())
        got = received()
        assert got["flushes"] == 1  # after the last bucket
        for k, v in state.items():
            assert torch.equal(torch.tensor(got["tensors"][k]), v.flatten()), k
        # the next request runs on the new weights (step 3) under version 1
        [[c]] = engine.generate_many([[5]], SamplingParams(max_new_tokens=2, temperature=0.0))
        assert c.token_ids == [8, 11] and c.versions == [1, 1]
        # a second push reuses the group (no new rendezvous) and the new values arrive
        state["step"].fill_(4.0)
        sync.push(2)
        assert received()["tensors"]["step"] == [4.0] and engine.version == 2
        [[c]] = engine.generate_many([[5]], SamplingParams(max_new_tokens=1, temperature=0.0))
        assert c.token_ids == [9] and c.versions == [2]
        # what weir sent: the group's rendezvous once, then a call per ~1 KB bucket, in order
        log = [x for x in sent if "weights" in x[0]]
        update = "/update_weights_from_distributed"
        assert [x[0] for x in log] == ["/init_weights_update_group", *[update] * 6]
        init = log[0][1]
        assert (init["world_size"], init["rank_offset"], init["backend"]) == (2, 1, "gloo")
        first = [body for _, body in log[1:4]]  # model.b.weight (2 KB) travels alone
        assert [b["names"] for b in first] == [[k] for k in state]
        assert [b["shapes"] for b in first] == [[[3, 4]], [[64, 8]], [[1]]]
        assert [b["flush_cache"] for b in first] == [False, False, True]
    finally:
        engine.close()
        trainer.pool.shutdown(wait=False)


@pytest.mark.parametrize(
    ("fault", "at"),
    [("killed", "bucket"), ("stopped", "bucket"), ("stopped", "join")],
)
def test_an_sglang_server_failing_during_a_weight_broadcast_leaves_the_run_going(
    fault, at, tmp_path, monkeypatch, caplog
):
    """Two owned SGLang stand-ins take ~1 KB buckets over SGLang's distributed protocol. The
    second fails as it asks for its third bucket (`at="bucket"`) or to join the group
    (`at="join"`): killed (SIGKILL: its connections reset), or stopped (SIGSTOP: as a host that
    vanished without a TCP reset; its connections stay open and nothing answers, so only its
    unanswered /health checks tell). The sync aborts the group (rank 0 leaves at once, also from
    the rendezvous); the first server cannot abort its side (SGLang's endpoint, as the
    stand-in's, waits in the broadcast or the rendezvous), so after the grace it counts as
    wedged; both are restarted, the update is done with the version moved, and each server gets
    the new weights streamed from the shards when it is back: every tensor bit for bit."""
    import json
    import logging
    import os
    import signal
    import time
    import urllib.request

    import weir.sync.server_sync as server_sync
    from weir.sync.server_sync import ServerSync

    monkeypatch.setattr(server_sync, "ABORT_GRACE_S", 2.0)
    monkeypatch.setattr(server_sync, "LIVENESS_PERIOD_S", 0.3)
    monkeypatch.setattr(server_sync, "LIVENESS_MISSES", 2)
    path, nth = {
        "bucket": ("/update_weights_from_distributed", 3),
        "join": ("/init_weights_update_group", 1),
    }[at]
    script = Path(__file__).with_name("sglang_standin.py")
    procs = []
    for i in range(2):
        port = free_port()
        proc = ServerProcess(
            argv=[sys.executable, str(script), str(port)],
            url=f"http://127.0.0.1:{port}",
            log_path=tmp_path / f"standin{i}.log",
            startup_timeout_s=120,
        )
        proc.start()
        procs.append(proc)
    for proc in procs:
        proc.wait_ready()
    state = {f"model.l{i}.weight": torch.randn(16, 8) for i in range(12)}
    trainer = _Trainer(state)
    calls = [0]

    failing = path

    class Dying(SglangBackend):
        async def _post(self, client, url, path, body=None):
            if url == procs[1].url and path == failing:
                calls[0] += 1
                if calls[0] == nth and fault == "killed":
                    os.killpg(procs[1].proc.pid, signal.SIGKILL)
                    procs[1].proc.wait(10)
                elif calls[0] == nth:
                    os.killpg(procs[1].proc.pid, signal.SIGSTOP)
            return await super()._post(client, url, path, body)

    engine = ServerEngine(
        Dying(),
        [Replica(p.url, p) for p in procs],
        eos_token_ids=[EOS],
        max_model_len=4096,
        weights_dir=tmp_path / "weights",
        watch_s=0,
    )

    def received(url: str) -> dict:
        with urllib.request.urlopen(url + "/received", timeout=30) as r:  # noqa: S310
            return json.loads(r.read())["tensors"]

    try:
        sync = ServerSync(trainer, engine, bucket_mb=1e-3, backend="gloo")
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="weir.engine.server_engine"):
            stats = sync.push(1)
        assert calls[0] == nth and time.monotonic() - start < 60  # not gloo's 600 s
        unanswered = [u for u in (p.url for p in procs) if f"{u} failed 2 checks" in caplog.text]
        # a stopped server is found by its checks; the busy one answers them all along
        assert unanswered == ([procs[1].url] if fault == "stopped" else []), caplog.text
        assert stats["cluster/sync_retries"] == 1 and engine.version == 1
        assert engine.wait_healthy(120), "the servers did not come back"
        assert engine.restarts == 2
        for proc in procs:
            got = received(proc.url)
            for k, v in state.items():
                assert torch.equal(torch.tensor(got[k]), v.flatten()), (proc.url, k)
    finally:
        engine.close()
        for proc in procs:
            proc.stop()
        trainer.pool.shutdown(wait=False)
