"""`ServerEngine`: the `Engine` protocol over engine servers (vLLM, SGLang) reached by HTTP.

weir talks to each server in streaming mode, one HTTP request per sample (the `n` samples of one
prompt go to the same replica, whose prefix cache shares their prompt). Streaming is what makes the
protocol exact on a server weir does not control: the client holds every token it has received,
with its log-prob and the weight version that was current when it arrived, so

- ``pause`` closes the streams in flight (the server aborts those requests) and keeps the tokens so
  far; ``resume`` resubmits each sample as *prompt + tokens so far* with the remaining budget, so it
  continues where it stopped;
- ``update_weights`` is pause -> load -> set ``version`` -> resume: tokens before the update carry
  the old version, tokens after it the new one, and the continuation is computed by the new weights
  on the full context (the same semantics as the torch engine's KV recomputation);
- ``abort`` ends every sample in flight with finish_reason "abort", its tokens so far kept;
- a server that dies is restarted (when weir started it), given the current weights, and the
  samples it was serving continue there (or on another replica) from their last received token:
  nothing is lost and no token is produced twice. A watcher polls the processes weir started, so a
  server that dies between requests is restarted at once, not when the next request meets it.

Backends (`ServerBackend`) say how to start a server, phrase a request, read a stream chunk, load
weights from a safetensors directory, and sleep/wake. Everything here runs in one asyncio loop in a
daemon thread, so the engine can be used from any thread or event loop (like `TorchEngine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from weir.engine.base import Completion, SamplingParams
from weir.engine.router import NoEngineAvailable, least_loaded
from weir.engine.server_recovery import Recovery
from weir.engine.server_updates import WeightUpdates
from weir.engine.servers import Replica

log = logging.getLogger(__name__)

MASK63 = (1 << 63) - 1


class ServerBackend(Protocol):
    """What differs between engine servers; see `VllmBackend` and `SglangBackend`."""

    name: str
    liveness_path: str
    """A GET that the server's HTTP process answers by itself, also while its workers are busy
    (loading weights): a weight update asks it to tell a server that is gone from a busy one."""

    def request(
        self, context: list[int], params: SamplingParams, max_tokens: int, seed: int
    ) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of a streaming request for ONE sample continuing `context`."""

    def parse_event(
        self, event: dict[str, Any], seen: int
    ) -> tuple[list[tuple[int, float]], str | None]:
        """The new (token id, log-prob) pairs of one stream event and its finish reason, if any;
        `seen` tokens of this stream were received before it."""

    async def load_from_disk(self, client: Any, url: str, path: str) -> None:
        """Make the server load the safetensors directory `path` (raise if it did not)."""

    async def sleep(self, client: Any, url: str) -> None: ...

    async def wake(self, client: Any, url: str) -> None: ...


class ServerError(RuntimeError):
    """The server answered a request with an error status (not a dead server)."""


@dataclass
class _Sample:
    prompt: list[int]
    params: SamplingParams
    seed: int
    epoch: int  # abort epoch at submission: a later abort() ends this sample
    replica: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    attempts: int = 0

    def completion(self) -> Completion:
        return Completion(list(self.tokens), list(self.logprobs), list(self.versions), self.finish)


def sample_seed(seed: int, index: int, done: int) -> int:
    """The server seed of sample `index` of a request seeded `seed`, continuing after `done`
    tokens (a resubmitted continuation must not replay the random numbers of its first part)."""
    x = (
        seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + done * 0x94D049BB133111EB
    ) & MASK63
    x ^= x >> 31
    return (x * 0xD6E8FEB86659FD93) & MASK63


class ServerEngine(Recovery, WeightUpdates):
    """The Engine protocol over `replicas` served by `backend`.

    Args:
        backend: how to talk to the servers.
        replicas: the servers (started or attached); they must already serve.
        eos_token_ids: always stop tokens (added to each request's stop ids).
        max_model_len: the servers' context limit (prompt + response); a sample that reaches it
            finishes with "length".
        seed: seeds requests that set none (in submission order).
        weights_dir: where `update_weights` writes the safetensors directory the servers load.
        restart: restart a server weir started when it dies.
        request_timeout_s: a stream that sends nothing for this long counts as a dead server.
        restore_weights: the safetensors directory a restarted server loads before it rejoins
            (None until the first update: the server starts with the initial weights).
        watch_s: how often the processes weir started are checked for having died (0: never; a
            dead server is then noticed by the next request sent to it).

    `restore`, when set (`weir.sync.server_sync.ServerSync.restore`), gives a restarted server the
    current weights instead of `restore_weights`: ``restore(index)`` blocks until it has them, or
    raises `WeightsNotReady`, and the server then waits in `awaiting` for the next update.
    """

    def __init__(
        self,
        backend: ServerBackend,
        replicas: Sequence[Replica],
        *,
        eos_token_ids: Sequence[int],
        max_model_len: int,
        seed: int = 0,
        weights_dir: str | Path,
        restart: bool = True,
        request_timeout_s: float = 600.0,
        version: int = 0,
        max_retries: int = 5,
        model_dir: str | Path | None = None,
        watch_s: float = 2.0,
    ) -> None:
        import httpx

        self.backend = backend
        self.replicas = list(replicas)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.max_model_len = int(max_model_len)
        self.version = version
        self.weights_dir = Path(weights_dir)
        self.model_dir = model_dir
        self.sleep_mode = False
        self.restart = restart
        self.max_retries = max_retries
        self.restore_path: str | None = None
        self.restore: Callable[[int], None] | None = None
        self.verify_loads = False  # servers digest what they load (cluster.verify_sync)
        self.awaiting: set[int] = set()  # restarted, waiting for the next weight update
        self._rng = random.Random(seed)
        self.outstanding = [0] * len(self.replicas)
        self.healthy = [True] * len(self.replicas)
        self.retries = 0
        self.restarts = 0
        self.update_retries = 0  # weight updates that went again after a server died in them
        self.sleeping = False
        self._wake_running = True
        self._stats = {"requests": 0, "generated_tokens": 0, "resubmits": 0, "busy_s": 0.0}
        self._busy_since: float | None = None
        self._inflight = 0
        self._epoch = 0
        self._streams: set[asyncio.Task] = set()
        self._recovering: dict[int, asyncio.Task] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weir-server-engine")
        self._thread.daemon = True
        self._thread.start()
        self._client = self._call(self._make_client(httpx, request_timeout_s))
        self._running = self._call(self._make_event())
        self._admitting = self._call(self._make_event())  # cleared by drain, set by resume
        self._none_running = self._call(self._make_event())  # set while no request is in flight
        self._requests_running = 0
        self._control = self._call(self._make_lock())
        self._closed = False
        self._watcher: asyncio.Task | None = None
        if restart and watch_s > 0 and any(r.owned for r in self.replicas):
            self._watcher = self._call(self._start_watch(watch_s))

    # -- plumbing ----------------------------------------------------------------------------------

    async def _make_client(self, httpx, timeout_s: float):
        return httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None),
        )

    async def _make_event(self) -> asyncio.Event:
        ev = asyncio.Event()
        ev.set()
        return ev

    async def _make_lock(self) -> asyncio.Lock:
        return asyncio.Lock()

    async def _start_watch(self, period_s: float) -> asyncio.Task:
        return asyncio.create_task(self._watch(period_s))

    def _call(self, coro: Coroutine) -> Any:
        """Run `coro` in the engine's loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _in_loop(self, coro: Coroutine) -> Any:
        """Run `coro` in the engine's loop from any event loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    # -- the Engine protocol -----------------------------------------------------------------------

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> list[Completion]:
        return await self._in_loop(self._generate([int(t) for t in prompt_ids], params))

    async def pause(self) -> None:
        await self._in_loop(self._pause())

    async def resume(self) -> None:
        await self._in_loop(self._resume())

    async def abort(self) -> None:
        await self._in_loop(self._abort())

    async def drain(self, timeout: float | None = None) -> bool:
        return await self._in_loop(self._drain(timeout))

    def pause_sync(self) -> None:
        self._call(self._pause())

    def resume_sync(self) -> None:
        self._call(self._resume())

    def abort_sync(self) -> None:
        self._call(self._abort())

    def drain_sync(self, timeout: float | None = None) -> bool:
        """Let the requests in flight finish, starting none of those that arrive meanwhile (they
        wait for `resume_sync`); returns True once none is in flight, False if `timeout` seconds
        pass first (the rest keep running)."""
        return self._call(self._drain(timeout))

    def sleep_sync(self) -> None:
        """Pause and release the servers' memory (weights and KV cache) until `wake_sync`."""
        self._call(self._sleep())

    def wake_sync(self) -> None:
        self._call(self._wake())

    def generate_many(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> list[list[Completion]]:
        """Submit every prompt at once and wait for all; one list of completions per prompt."""

        async def run():
            return await asyncio.gather(
                *(self._generate([int(t) for t in p], params) for p in prompts)
            )

        return self._call(run())

    def stats(self) -> dict[str, float]:
        """Counters since start: requests, generated tokens, resubmitted samples, busy seconds,
        retries after a server failure, server restarts, and weight updates that went again after a
        server died during them."""
        out = dict(self._stats)
        if self._busy_since is not None:
            out["busy_s"] += time.perf_counter() - self._busy_since
        out["engine_retries"] = float(self.retries)
        out["engine_restarts"] = float(self.restarts)
        out["engine_update_retries"] = float(self.update_retries)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The seed stream of unseeded requests and the weight version (for checkpoints)."""
        return {"rng": self._rng.getstate(), "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rng.setstate(state["rng"])
        self.version = state["version"]

    @contextlib.contextmanager
    def asleep(self, update_follows: bool = False) -> Iterator[None]:
        """With `sleep_mode`: the servers release their memory for the block (colocated training),
        then wake. Without it: nothing happens. (`update_follows` is for the built-in engine: a
        server wakes as its own sleep mode does.)"""
        if not self.sleep_mode:
            yield
            return
        self.sleep_sync()
        try:
            yield
        finally:
            self.wake_sync()

    def close(self) -> None:
        """Abort what is in flight, stop the servers weir started, stop the loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            if self._watcher is not None:
                self._loop.call_soon_threadsafe(self._watcher.cancel)
            self._call(self._abort())
            self._call(self._stop_recovery())
            self._call(self._client.aclose())
        for r in self.replicas:
            if r.process is not None:
                r.process.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # -- generation --------------------------------------------------------------------------------

    async def _generate(self, prompt: list[int], params: SamplingParams | None) -> list[Completion]:
        params = params or SamplingParams()
        if params.top_p < 1.0 or params.top_k > 0:
            raise ValueError(
                f"{self.backend.name} engine: top_p={params.top_p} / top_k={params.top_k} would make "
                "the server report log-probs renormalised over the kept tokens, not weir's "
                "convention (weir.engine.base); use top_p=1.0 and top_k=0"
            )
        if not prompt:
            raise ValueError("generate: the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"generate: the prompt has {len(prompt)} tokens; the engine's context limit is "
                f"{self.max_model_len} (engine.max_model_len)"
            )
        self._stats["requests"] += 1
        if params.max_new_tokens == 0:
            return [Completion([], [], [], "length") for _ in range(params.n)]
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        await self._admitting.wait()
        self._requests_running += 1
        self._none_running.clear()
        try:
            replica = await self._pick()
            samples = [
                _Sample(prompt, params, sample_seed(seed, i, 0), self._epoch, replica)
                for i in range(params.n)
            ]
            self.outstanding[replica] += 1
            try:
                await asyncio.gather(*(self._run(s, i) for i, s in enumerate(samples)))
            finally:
                self.outstanding[replica] -= 1
        finally:
            self._requests_running -= 1
            if not self._requests_running:
                self._none_running.set()
        return [s.completion() for s in samples]

    async def _pick(self) -> int:
        while True:
            i = least_loaded(self.outstanding, self.healthy)
            if i is not None:
                return i
            if self._closed or not self._recovering:
                raise NoEngineAvailable(
                    f"no {self.backend.name} server is up (all {len(self.replicas)} failed and none "
                    "is being restarted); see the server logs under the run's engine/ directory"
                )
            await asyncio.sleep(0.05)

    async def _run(self, s: _Sample, index: int) -> None:
        """Drive one sample to its end, across pauses, weight updates and server failures."""
        while s.finish is None:
            await self._running.wait()
            if s.epoch < self._epoch:
                s.finish = "abort"
                return
            budget = min(
                s.params.max_new_tokens - len(s.tokens),
                self.max_model_len - len(s.prompt) - len(s.tokens),
            )
            if budget <= 0:
                s.finish = "length"
                return
            if not self.healthy[s.replica]:
                s.replica = await self._pick()
            seed = sample_seed(s.seed, index, len(s.tokens))
            task = asyncio.create_task(self._stream(s, budget, seed))
            self._streams.add(task)
            self._busy(+1)
            try:
                await asyncio.wait({task})
            finally:
                self._streams.discard(task)
                self._busy(-1)
            if task.cancelled():  # pause / update / abort: keep the tokens, decide above
                if s.finish is None:
                    self._stats["resubmits"] += 1
                continue
            err = task.exception()
            if err is None:
                continue
            if isinstance(err, ServerError):
                raise err
            s.attempts += 1
            self.retries += 1
            if s.attempts > self.max_retries:
                raise RuntimeError(
                    f"{self.backend.name} engine: a sample failed {s.attempts} times; last error: "
                    f"{type(err).__name__}: {err}"
                ) from err
            log.warning(
                "%s server %s failed (%s: %s); retrying the sample with its %d tokens so far",
                self.backend.name,
                self.replicas[s.replica].url,
                type(err).__name__,
                err,
                len(s.tokens),
            )
            await self._lost(s.replica)

    async def _stream(self, s: _Sample, budget: int, seed: int) -> None:
        context = s.prompt + s.tokens
        params = SamplingParams(
            n=1,
            temperature=s.params.temperature,
            top_p=s.params.top_p,
            top_k=s.params.top_k,
            max_new_tokens=budget,
            stop_token_ids=sorted(set(s.params.stop_token_ids) | set(self.eos_token_ids)),
            seed=seed,
        )
        path, body = self.backend.request(context, params, budget, seed)
        url = self.replicas[s.replica].url + path
        seen = 0
        async with self._client.stream("POST", url, json=body) as resp:
            if resp.status_code >= 400:
                text = (await resp.aread()).decode(errors="replace")[:500]
                if resp.status_code >= 500 and not await asyncio.to_thread(self._alive, s.replica):
                    raise ConnectionError(f"{resp.status_code}: {text}")
                raise ServerError(
                    f"{self.backend.name} server {url} answered {resp.status_code}: {text}"
                )
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event and not event.get("choices"):
                    raise ServerError(f"{self.backend.name} server {url}: {event['error']}")
                pairs, finish = self.backend.parse_event(event, seen)
                seen += len(pairs)
                version = self.version
                for tok, lp in pairs:
                    s.tokens.append(tok)
                    s.logprobs.append(lp)
                    s.versions.append(version)
                self._stats["generated_tokens"] += len(pairs)
                if finish is not None:
                    s.finish = finish
        if s.finish is None:
            raise ConnectionError("the stream ended without a finish reason")

    def _busy(self, delta: int) -> None:
        now = time.perf_counter()
        if self._inflight == 0 and delta > 0:
            self._busy_since = now
        self._inflight += delta
        if self._inflight == 0 and self._busy_since is not None:
            self._stats["busy_s"] += now - self._busy_since
            self._busy_since = None

    # -- control -----------------------------------------------------------------------------------

    async def _stop_streams(self) -> None:
        tasks = list(self._streams)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _pause(self) -> None:
        self._running.clear()
        await self._stop_streams()

    async def _resume(self) -> None:
        self._admitting.set()
        if not self.sleeping:
            self._running.set()

    async def _drain(self, timeout: float | None = None) -> bool:
        if not self._running.is_set():
            raise RuntimeError("drain: the engine is paused or asleep; resume or wake it first")
        self._admitting.clear()
        try:
            await asyncio.wait_for(self._none_running.wait(), timeout)
        except asyncio.TimeoutError:  # noqa: UP041 (Python 3.10: not the builtin)
            return False
        return True

    async def _abort(self) -> None:
        self._epoch += 1
        await self._stop_streams()

    async def _sleep(self) -> None:
        async with self._control:
            self._wake_running = self._running.is_set()
            await self._pause()
            await self._sleep_servers()
            self.sleeping = True

    async def _wake(self) -> None:
        async with self._control:
            await self._wake_servers()
            self.sleeping = False
            if self._wake_running:
                self._running.set()

    async def _sleep_servers(self) -> None:
        await asyncio.gather(
            *(
                self.backend.sleep(self._client, r.url)
                for i, r in enumerate(self.replicas)
                if self.healthy[i]
            )
        )

    async def _wake_servers(self) -> None:
        await asyncio.gather(
            *(
                self.backend.wake(self._client, r.url)
                for i, r in enumerate(self.replicas)
                if self.healthy[i]
            )
        )
