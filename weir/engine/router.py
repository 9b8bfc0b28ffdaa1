"""A router over engine replicas (Ray actors) that is itself an `Engine`.

Rollout functions call `generate(prompt_ids, params)` as on one engine. The router sends each
call to the healthy replica with the fewest requests outstanding; the `n` samples of one prompt
are one call and so stay on one replica (its KV cache shares their prefix).

Failure: a replica that dies mid-request is marked down and the request is retried on another
replica, so the step completes. Ray restarts the actor (`max_restarts`); a recovery thread waits
until it answers, hands it the current weights through `restore(index, actor)` and only then lets
it take requests again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from weir.engine.base import Completion, SamplingParams, SyncControl, summed_stats

log = logging.getLogger(__name__)


class NoEngineAvailable(RuntimeError):
    """Every replica is down and none came back in time."""


def least_loaded(outstanding: list[int], healthy: list[bool] | None = None) -> int | None:
    """The healthy replica with the fewest requests outstanding (lowest index on a tie), or None.
    `healthy` None: every replica is."""
    if healthy is None:
        healthy = [True] * len(outstanding)
    live = [i for i, ok in enumerate(healthy) if ok]
    return min(live, key=lambda k: (outstanding[k], k)) if live else None


class Router(SyncControl):
    """Engine protocol over `replicas` (Ray actor handles of `EngineWorker`).

    Args:
        replicas: the engine actors.
        restore: called with (index, actor) for a restarted replica before it rejoins; it must
            load the current weights and version into it. None: rejoin as is.
        version: the weight version the replicas start with.
        wait_s: how long a request waits for some replica to be healthy before failing.
        seed: seeds the router's stream of request seeds. A request without
            `SamplingParams.seed` gets the next seed of this stream when `generate` is called, so
            its samples do not depend on which replica serves it, when the request reaches it, or
            on a retry elsewhere (the replicas' own streams would depend on arrival order).
    """

    def __init__(
        self,
        replicas: list[Any],
        *,
        restore: Callable[[int, Any], None] | None = None,
        version: int = 0,
        wait_s: float = 300.0,
        seed: int = 0,
    ) -> None:
        self.replicas = list(replicas)
        self._rng = random.Random(seed)
        self.restore = restore
        self.version = version
        self.wait_s = wait_s
        self.outstanding = [0] * len(self.replicas)
        self.healthy = [True] * len(self.replicas)
        self.retries = 0
        self.restarts = 0
        self._lock = threading.Lock()
        self._recovering: set[int] = set()
        self._closed = False
        self.sleep_mode = False  # see `asleep`
        self.sleep_offload_weights = False

    # -- routing ------------------------------------------------------------------------------------

    def _pick(self) -> int | None:
        with self._lock:
            i = least_loaded(self.outstanding, self.healthy)
            if i is not None:
                self.outstanding[i] += 1
            return i

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, vision: Any = None
    ) -> list[Completion]:
        """`params.n` completions of `prompt_ids` (with `vision`, a vision-language model's pixel
        inputs for the prompt's images) from the least loaded healthy replica."""
        from ray.exceptions import RayActorError

        if params.seed is None:  # in call order, which the driver's event loop makes deterministic
            params = dataclasses.replace(params, seed=self._rng.getrandbits(64))
        deadline = time.monotonic() + self.wait_s
        while True:
            i = self._pick()
            if i is None:
                if self._closed or time.monotonic() > deadline:
                    raise NoEngineAvailable(
                        f"no engine replica is up (all {len(self.replicas)} died and none "
                        f"restarted within {self.wait_s:.0f} s)"
                    )
                await asyncio.sleep(0.05)
                continue
            try:
                if vision is None:
                    return await self.replicas[i].generate.remote(list(prompt_ids), params)
                return await self.replicas[i].generate.remote(list(prompt_ids), params, vision)
            except RayActorError as err:
                self.retries += 1
                self._lost(i, err)
            finally:
                with self._lock:
                    self.outstanding[i] -= 1

    # -- failure and recovery -----------------------------------------------------------------------

    def _lost(self, i: int, err: BaseException) -> None:
        with self._lock:
            if not self.healthy[i] or self._closed:
                return
            self.healthy[i] = False
            self._recovering.add(i)
        log.warning("engine replica %d died (%s); retrying its requests elsewhere", i, err)
        threading.Thread(target=self._recover, args=(i,), daemon=True).start()

    def _recover(self, i: int, timeout_s: float = 300.0) -> None:
        import ray

        deadline = time.monotonic() + timeout_s
        while not self._closed and time.monotonic() < deadline:
            try:
                ray.get(self.replicas[i].ping.remote(), timeout=30)
                if self.restore is not None:
                    self.restore(i, self.replicas[i])
                with self._lock:
                    self.healthy[i] = True
                    self._recovering.discard(i)
                    self.restarts += 1
                log.warning("engine replica %d is back with weights version %d", i, self.version)
                return
            except ray.exceptions.ActorDiedError:
                break  # out of restarts: the replica stays down
            except Exception:  # still restarting
                time.sleep(0.2)
        with self._lock:
            self._recovering.discard(i)

    def wait_healthy(self, timeout_s: float = 120.0) -> bool:
        """Block until no replica is recovering (True) or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._recovering:
                    return True
            time.sleep(0.05)
        return False

    def live(self) -> list[tuple[int, Any]]:
        with self._lock:
            return [(i, r) for i, r in enumerate(self.replicas) if self.healthy[i]]

    # -- the rest of the Engine protocol -------------------------------------------------------------

    def _each(self, method: str, *args) -> list:
        """Call `method` on every healthy replica and wait; a replica that dies meanwhile is lost."""
        import ray
        from ray.exceptions import RayActorError

        live = self.live()
        refs = [getattr(r, method).remote(*args) for _, r in live]
        out = []
        for (i, _), ref in zip(live, refs, strict=True):
            try:
                out.append(ray.get(ref))
            except RayActorError as err:
                self._lost(i, err)
        return out

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Through Ray's object store (one copy, read by every replica)."""
        import ray

        ref = ray.put({k: v.detach().cpu() for k, v in named_tensors})
        await asyncio.to_thread(self._each, "update_weights", ref, version)
        self.version = version

    def pause_sync(self) -> None:
        self._each("pause")

    def resume_sync(self) -> None:
        self._each("resume")

    def abort_sync(self) -> None:
        self._each("abort")

    def drain_sync(self, timeout: float | None = None) -> bool:
        """Every replica lets its requests in flight finish, admitting none until `resume_sync`;
        True once none runs anywhere, False if one still had some after `timeout` seconds (the
        replicas wait at the same time)."""
        return all(self._each("drain", timeout))

    def sleep_sync(self, offload_weights: bool = False) -> None:
        """Every replica frees its KV cache (and with `offload_weights` parks its weights in host
        memory) until `wake_sync`."""
        self._each("sleep", offload_weights)

    def wake_sync(self, update_follows: bool = False) -> None:
        """Every replica wakes; with `update_follows` offloaded weights wait for the weight update
        that comes next (weir.engine.memory.EngineMemory.wake_sync)."""
        self._each("wake", update_follows)

    @contextlib.contextmanager
    def asleep(self, update_follows: bool = False) -> Iterator[None]:
        """With `sleep_mode` (colocated replicas): asleep for the block (the trainer trains on
        their devices), awake after it, also on error. Without it: nothing happens."""
        if not self.sleep_mode:
            yield
            return
        self.sleep_sync(self.sleep_offload_weights)
        try:
            yield
        finally:
            self.wake_sync(update_follows)

    async def resume(self) -> None:
        await asyncio.to_thread(self.resume_sync)  # a Ray call to every replica: it waits

    def stats(self) -> dict[str, float]:
        """Counters summed over the healthy replicas (busy_s: their mean), plus the router's
        retries and restarts."""
        total = summed_stats(self._each("stats"))
        total["engine_retries"] = float(self.retries)
        total["engine_restarts"] = float(self.restarts)
        return total

    def state_dict(self) -> dict[str, Any]:
        """The router's stream of request seeds, and every healthy replica's own stream and
        version by replica index: with them a resumed run samples what the uninterrupted run
        would have."""
        live = self.live()
        states = self._each("state_dict")
        if len(states) != len(live):  # a replica died meanwhile: save none rather than misalign
            states, live = [], []
        replicas = {i: s for (i, _), s in zip(live, states, strict=True)}
        return {"rng": self._rng.getstate(), "replicas": replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what `state_dict` saved, into the router and the live replicas of each index."""
        import ray

        if "rng" in state:
            self._rng.setstate(state["rng"])
        saved = state.get("replicas", {})
        ray.get([r.load_state_dict.remote(saved[i]) for i, r in self.live() if i in saved])

    def close(self) -> None:
        import ray

        self._closed = True
        for r in self.replicas:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(r, no_restart=True)
