"""Server engines without a server: what a user sees when one cannot start, what the config refuses
up front, seeds, and the router's choice of replica. No vLLM needed: these run everywhere."""

from __future__ import annotations

import contextlib
import sys
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weir.config import load_config
from weir.config.schema import EngineConfig
from weir.engine.server_engine import sample_seed
from weir.engine.servers import (
    EngineNotInstalled,
    EngineStartError,
    ServerProcess,
    check_installed,
    free_port,
)
from weir.engine.vllm_engine import start_vllm


def test_vllm_not_installed_names_the_install_command(tmp_path):
    cfg = EngineConfig(
        type="vllm", python=sys.executable, max_model_len=64
    )  # weir's own env has no vllm
    with pytest.raises(EngineNotInstalled, match="make setup-vllm"):
        start_vllm(cfg, str(tmp_path), tmp_path, eos_token_ids=[1], dtype="float32", seed=0)
    cfg = EngineConfig(type="vllm", python=str(tmp_path / "no-such-python"), max_model_len=64)
    with pytest.raises(EngineNotInstalled, match="does not exist.*make setup-vllm"):
        start_vllm(cfg, str(tmp_path), tmp_path, eos_token_ids=[1], dtype="float32", seed=0)


def test_an_engine_environment_that_imports_is_probed_once_and_a_broken_one_every_time(tmp_path):
    """Importing vLLM takes 15-20 s on a small CPU: a process that starts many servers from one
    environment probes it once; an environment that failed is probed again (it may have been
    fixed), and says why each time."""
    python = tmp_path / "python"
    calls = tmp_path / "calls"
    python.write_text(
        f"#!/bin/sh\necho x >> {calls}\n[ -e {tmp_path / 'broken'} ] && exit 1\nexit 0\n"
    )
    python.chmod(0o755)
    for _ in range(3):
        check_installed(str(python), "fake_engine_a", "make setup-fake")
    assert calls.read_text().count("x") == 1
    (tmp_path / "broken").touch()
    for _ in range(2):
        with pytest.raises(
            EngineNotInstalled, match="fake_engine_b does not import.*make setup-fake"
        ):
            check_installed(str(python), "fake_engine_b", "make setup-fake")
    assert calls.read_text().count("x") == 3
    (tmp_path / "broken").unlink()
    check_installed(str(python), "fake_engine_b", "make setup-fake")
    check_installed(str(python), "fake_engine_b", "make setup-fake")
    assert calls.read_text().count("x") == 4


def test_a_server_that_dies_at_start_shows_its_log_tail(tmp_path):
    script = (
        "import sys; print('loading model'); print('CUDA out of memory: tried 9 GiB'); sys.exit(3)"
    )
    port = free_port()
    proc = ServerProcess(
        [sys.executable, "-c", script], f"http://127.0.0.1:{port}", log_path=tmp_path / "s.log"
    )
    proc.start()
    with pytest.raises(EngineStartError) as err:
        proc.wait_ready()
    msg = str(err.value)
    assert "exited with code 3" in msg and "CUDA out of memory: tried 9 GiB" in msg
    assert str(tmp_path / "s.log") in msg


def test_a_server_that_never_answers_times_out_with_its_log(tmp_path):
    script = "import time; print('still compiling', flush=True); time.sleep(60)"
    proc = ServerProcess(
        [sys.executable, "-c", script],
        f"http://127.0.0.1:{free_port()}",
        log_path=tmp_path / "s.log",
        startup_timeout_s=1.5,
    )
    proc.start()
    with pytest.raises(EngineStartError, match="did not answer /health within 2 s"):
        proc.wait_ready()
    assert not proc.alive()  # stopped, not left behind
    assert "still compiling" in (tmp_path / "s.log").read_text()


@pytest.mark.parametrize(
    "override, needle",
    [
        (["rollout.top_p=0.9"], "rollout.top_p=1.0"),
        (["rollout.top_k=20"], "rollout.top_k=0"),
        (["cluster.type=ray", "cluster.weight_sync=object_store"], "use broadcast"),
    ],
)
def test_config_refuses_what_a_server_engine_cannot_run_exactly(override, needle):
    with pytest.raises(ValueError, match=needle):
        load_config(None, ["engine.type=vllm", *override])
    load_config(None, ["engine.type=torch", *override])


@given(
    st.integers(0, 2**63 - 1),
    st.integers(0, 63),
    st.integers(0, 63),
    st.integers(0, 4096),
    st.integers(0, 4096),
)
def test_sample_seeds_are_distinct_per_sample_and_continuation(seed, i, j, a, b):
    s = sample_seed(seed, i, a)
    assert 0 <= s < 2**63
    assert s == sample_seed(seed, i, a)
    if (i, a) != (j, b):
        assert s != sample_seed(seed, j, b)


def test_context_limit_defaults_to_the_models_and_is_capped_by_it(tmp_path):
    from weir.engine.servers import model_max_len

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 512}')
    assert model_max_len(tmp_path, None) == 512
    assert model_max_len(tmp_path, 256) == 256
    with pytest.raises(ValueError, match="engine.max_model_len <= 512"):
        model_max_len(tmp_path, 2048)


@given(st.lists(st.tuples(st.integers(0, 9), st.booleans()), min_size=1, max_size=8))
def test_router_picks_the_least_loaded_healthy_replica(reps):
    from weir.engine.router import least_loaded

    outstanding, healthy = [o for o, _ in reps], [h for _, h in reps]
    i = least_loaded(outstanding, healthy)
    live = [k for k, h in enumerate(healthy) if h]
    if not live:
        assert i is None
        return
    assert healthy[i] and outstanding[i] == min(outstanding[k] for k in live)
    assert i == min(k for k in live if outstanding[k] == outstanding[i])  # lowest index on a tie


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_one_kv_budget_key_sizes_every_engine(tiny_model_dir):
    """engine.kv_budget_gb / kv_budget_fraction reach vLLM and SGLang as their own flags."""
    from transformers import AutoConfig

    from weir.engine.sglang_engine import kv_pool_tokens, sglang_argv
    from weir.engine.vllm_engine import executor_backend, vllm_argv, vllm_env

    common = dict(dtype="bfloat16", max_model_len=512, seed=0, sleep_mode=True, extra_args=[])
    gpu = vllm_argv("py", "m", 1, **common, on_gpu=True, kv_budget_gb=2.0, kv_budget_fraction=0.7)
    assert _flag(gpu, "--kv-cache-memory-bytes") == str(2 * 1024**3)
    assert _flag(gpu, "--gpu-memory-utilization") == "0.7"
    assert "--enforce-eager" not in gpu and "--enable-sleep-mode" in gpu  # CUDA graphs stay on
    cpu = vllm_argv("py", "m", 1, **common, on_gpu=False, kv_budget_gb=2.0)
    assert "--enforce-eager" in cpu and "--kv-cache-memory-bytes" not in cpu
    assert "--enable-sleep-mode" not in cpu
    # on a CPU the one worker runs in the engine core's process, unless the user names a backend
    assert executor_backend(gpu) is None and executor_backend(cpu) == "uni"
    mp = ["--distributed-executor-backend=mp"]
    assert (
        executor_backend(vllm_argv("py", "m", 1, **{**common, "extra_args": mp}, on_gpu=False))
        == "mp"
    )
    assert executor_backend(["--distributed_executor_backend", "mp"]) == "mp"
    assert vllm_env(None, uni=True)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm_env(None)
    assert vllm_env(None)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert vllm_env(2.5)["VLLM_CPU_KVCACHE_SPACE"] == "3"

    c = AutoConfig.from_pretrained(tiny_model_dir)
    kv_heads = c.num_key_value_heads or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * 2  # keys and values, bf16
    tokens = kv_pool_tokens(str(tiny_model_dir), "bfloat16", 0.5)
    assert tokens == (1024**3 // 2) // per_token
    argv = sglang_argv(
        "py", "m", 1, dtype="bfloat16", max_model_len=512, seed=0, memory_saver=False,
        extra_args=[], kv_tokens=tokens, kv_budget_fraction=0.6,
    )  # fmt: skip
    assert _flag(argv, "--max-total-tokens") == str(tokens)
    assert _flag(argv, "--mem-fraction-static") == "0.6"
    assert kv_pool_tokens(str(tiny_model_dir), "bfloat16", None) is None


class _Process:
    """A stand-in for a server process weir started: alive or exited."""

    def __init__(self, url: str, alive: bool) -> None:
        self.url, self._alive, self.stopped, self.restarted = url, alive, False, False

    def alive(self) -> bool:
        return self._alive

    def wait_ready(self, should_stop=None) -> None:
        raise EngineStartError(f"{self.url} did not come back")  # stays down in this test

    def restart(self, should_stop=None) -> None:
        self.restarted = True
        self.wait_ready()

    def stop(self) -> None:
        self.stopped = True


def test_a_server_that_exited_before_a_weight_update_is_left_out_and_restarted(tmp_path, caplog):
    """A server killed while the trainer trained is still marked healthy when the weights go out
    (no request has failed on it yet); a broadcast that includes it fails the whole update (a
    full-suite run's `test_vllm_on_ray`: "weight sync: delivery failed ... Connection closed by
    peer"). The update now goes to the servers whose process lives; the exited one is marked down
    and handed to recovery, with a warning naming it."""
    import logging

    from weir.engine.server_engine import ServerEngine
    from weir.engine.servers import Replica

    class Backend:
        name = "vllm"

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    replicas = [
        Replica(u, _Process(u, alive)) for u, alive in zip(urls, (True, False), strict=True)
    ]
    engine = ServerEngine(
        Backend(), replicas, eos_token_ids=[1], max_model_len=64, weights_dir=tmp_path, watch_s=0
    )
    loaded: list[list[int]] = []

    async def load(targets):
        loaded.append([i for i, _ in targets])

    try:
        with caplog.at_level(logging.WARNING, logger="weir.engine.server_engine"):
            engine.update_with_sync(load, 3)
        assert loaded == [[0]] and engine.version == 3
        assert engine.healthy == [True, False]
        assert any(urls[1] in r.getMessage() and "exited" in r.getMessage() for r in caplog.records)
        engine.update_with_sync(load, 4)  # down: not a target until it is back
        assert loaded[-1] == [0] and engine.version == 4
    finally:
        engine.close()


@contextlib.contextmanager
def _answering_health(n: int):
    """`n` URLs whose /health answers 200 (servers that serve), each on a thread of its own."""
    import http.server

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health) for _ in range(n)]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield [f"http://127.0.0.1:{srv.server_address[1]}" for srv in servers]
    finally:
        for srv in servers:
            srv.shutdown()


def test_a_server_dying_during_a_weight_update_is_shed_and_the_update_goes_to_the_others(
    tmp_path, caplog
):
    """Three servers; the second dies while the weights travel and the load fails (a broadcast
    whose group the sync aborted). The update goes again to the two that still serve, the dead
    one is marked down and restarted, and the retry is counted. A server left waiting in an
    aborted broadcast (`wedged`) is restarted although it answers /health. A failure that costs
    no server (all still serve) is the update's: it raises and the version stays."""
    import logging

    from weir.engine.server_engine import ServerEngine
    from weir.engine.servers import Replica
    from weir.sync.server_sync import DeliveryFailed

    class Backend:
        name = "vllm"

    with _answering_health(2) as (a, c):
        dead = f"http://127.0.0.1:{free_port()}"  # nothing answers there once it died
        procs = [_Process(u, True) for u in (a, dead, c)]
        replicas = [Replica(p.url, p) for p in procs]
        engine = ServerEngine(
            Backend(),
            replicas,
            eos_token_ids=[1],
            max_model_len=64,
            weights_dir=tmp_path,
            watch_s=0,
        )
        loaded: list[list[int]] = []

        async def load(targets):
            loaded.append([i for i, _ in targets])
            if len(loaded) == 1:
                procs[1]._alive = False  # dies half way
                raise DeliveryFailed("weight sync: a member of group g failed (...)")

        try:
            with caplog.at_level(logging.WARNING, logger="weir.engine.server_engine"):
                engine.update_with_sync(load, 3)
            assert loaded == [[0, 1, 2], [0, 2]] and engine.version == 3
            assert engine.healthy == [True, False, True] and engine.update_retries == 1
            assert engine.stats()["engine_update_retries"] == 1.0
            assert any("1 of 3 servers lost" in r.getMessage() for r in caplog.records)
            engine.wait_healthy(timeout_s=2.0)  # its recovery ends (the stand-in stays down)
            assert procs[1].restarted

            async def fails(targets):
                loaded.append([i for i, _ in targets])
                raise RuntimeError("weight sync: the trainer failed")

            with pytest.raises(RuntimeError, match="the trainer failed"):
                engine.update_with_sync(fails, 4)
            assert loaded[-1] == [0, 2] and engine.version == 3 and engine.update_retries == 1

            async def wedges(targets):
                loaded.append([i for i, _ in targets])
                if len(loaded) == 4:
                    raise DeliveryFailed("... servers still in it", frozenset({c}))

            engine.update_with_sync(wedges, 5)
            assert loaded[-2:] == [[0, 2], [0]] and engine.version == 5
            engine.wait_healthy(timeout_s=2.0)
            assert procs[2].restarted and not procs[0].restarted
            assert engine.healthy == [True, False, False] and engine.update_retries == 2
        finally:
            engine.close()


def test_a_server_host_loads_neither_torch_nor_transformers(tmp_path):
    """A Ray actor owning a vLLM or SGLang server imports `ServerHost` and unpickles the run's
    launcher; it starts the server as a child process and needs neither torch nor transformers
    (each would cost the actor seconds of CPU to import, and memory for as long as it lives)."""
    import pickle

    from tests.fresh_python import printed_words
    from weir.engine.vllm_engine import VllmLauncher

    launcher = VllmLauncher(
        python="py", model_path="m", work_dir=tmp_path, dtype="float32", max_model_len=64, seed=0,
        sleep_mode=False, extra_args=(), kv_budget_gb=None, kv_budget_fraction=None,
        startup_timeout_s=1.0,
    )  # fmt: skip
    program = (
        "import pickle, sys; from weir.engine.server_host import ServerHost; "
        "import weir.engine.sglang_engine; "
        f"launch = pickle.loads({pickle.dumps(launcher)!r}); "
        "proc = launch(0, 1234); "
        "print(type(proc).__name__, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    assert printed_words(program) == ["ServerProcess", "False", "False"]
