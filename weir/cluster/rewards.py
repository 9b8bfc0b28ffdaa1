"""Reward functions in a pool of Ray actors: scoring leaves the driver, so a slow or CPU-heavy
reward neither holds the driver's GIL nor delays the requests it routes.

The actors are long-lived (a warm process each, no start-up per call) and asynchronous: each
scores many samples at once, sync functions in its worker threads. Calls go to the actor with
the fewest in flight. A pool is ready before anything is scored: `reward.timeout_s` bounds the
reward function, not a worker's start-up (importing the function's module, and torch where it
needs it, which on a loaded machine took longer than the 30 s default and failed a first
evaluation's every sample).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

START_TIMEOUT_S = 300.0
"""How long a pool waits for its workers to start (each imports the reward's module)."""


class RewardWorker:
    """One scoring process: calls `fn(sample, row)` (sync in a thread, async awaited)."""

    def __init__(self, fn: Callable) -> None:
        """One torch thread, whenever torch is imported: `fn`'s module may have imported it while
        `fn` was unpickled; otherwise OpenMP reads the variable when torch loads. A worker whose
        reward needs no torch never imports it (importing torch costs a process about 200 MB of
        memory)."""
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
        self.fn = fn

    def ready(self) -> bool:
        return True

    async def score(self, sample: Any, row: Any) -> Any:
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(sample, row)
        result = await asyncio.to_thread(self.fn, sample, row)
        return await result if inspect.isawaitable(result) else result


class RewardPool:
    """`workers` RewardWorker actors for one reward function; `.reward` is the async callable to
    put in the rollout context.

    The pool is started when it is built (`wait=True`), or, with `wait=False`, its actors start
    while the caller goes on and `wait_started()` waits for them: a Ray run starts its reward
    workers beside its trainer ranks and engines (weir.loop.ray_build)."""

    def __init__(
        self,
        fn: Callable,
        workers: int = 2,
        num_cpus: float = 0.25,
        start_timeout_s: float = START_TIMEOUT_S,
        *,
        wait: bool = True,
    ) -> None:
        import ray

        from weir.rollout.rewards import reward_name

        remote = ray.remote(RewardWorker).options(num_cpus=num_cpus, max_restarts=-1)
        self.actors = [remote.remote(fn) for _ in range(workers)]
        self.load = [0] * workers
        self._lock = threading.Lock()
        self._name, self._timeout_s = reward_name(fn), start_timeout_s
        self.reward = self._wrap(fn)
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Block until every actor has built its RewardWorker; a worker that cannot start (its
        function's module does not import there) or does not within the start timeout ends the
        run with the reason (a ValueError, as a placement that Ray cannot make: the user's to
        fix), instead of failing samples one by one."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            ray.get([a.ready.remote() for a in self.actors], timeout=self._timeout_s)
            return
        except GetTimeoutError:
            why = (
                f"did not start within {self._timeout_s:.0f} s (is the Ray cluster short of CPUs?)"
            )
        except RayActorError as err:
            why = f"could not start: {str(err).strip().splitlines()[-1]}"
        self.shutdown()
        raise ValueError(f"cluster.reward_workers: the reward workers for {self._name} {why}")

    def _wrap(self, fn: Callable) -> Callable:
        from ray.exceptions import RayTaskError

        async def reward(sample: Any, row: Any) -> Any:
            with self._lock:
                i = min(range(len(self.actors)), key=lambda k: (self.load[k], k))
                self.load[i] += 1
            ref = self.actors[i].score.remote(sample, row)
            try:
                return await ref
            except RayTaskError as err:
                raise err.as_instanceof_cause() from None
            finally:
                with self._lock:
                    self.load[i] -= 1

        if hasattr(fn, "__name__"):  # error messages name the user's function
            functools.update_wrapper(reward, fn)
        return reward

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []
