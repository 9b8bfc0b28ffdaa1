"""Several built-in engines, each in a child process of its own, behind one `Engine`
(`engine.process=true` with `engine.replicas` > 1, cluster.type=local).

Why: on a CPU, a decode step of a small model is a few hundred small operations, and a second
intra-op thread does not make them faster (docs/dev/engine-speed.md). A second engine process decoding
half of the rows on another core does: on a 2-core machine, two engines of 32 rows each generated
workload B's 64 x 128 tokens in 0.70 s where one engine of 64 rows took 0.98 s
(`benchmarks/decode_bounds.py`). It is `weir.engine.router.Router`'s idea without Ray, for one
machine: no cluster to start, and the replicas' weights travel through shared memory.

Routing: each prompt (its n samples together, so that they share the prompt's KV) goes to the
replica with the fewest prompts outstanding, the lowest index on a tie. A request without
`SamplingParams.seed` gets the next seed of the group's own stream when it is submitted (`seed`),
so its samples do not depend on which replica serves it (each replica's own stream would depend
on what else it was sent).

Control: weight updates, pause, resume, abort, drain, sleep and wake go to every replica at once
(a thread each) and return when all have. `stats` sums the replicas' counters (``busy_s``: their
mean). The checkpoint state is the seed stream and each replica's state by index.

Failure: as with one engine process, a replica whose process dies fails its calls with
`weir.engine.process_engine.EngineProcessDied`, and the run stops with it; there is no restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from weir.engine.base import (
    Completion,
    FromSubmitMany,
    SamplingParams,
    SyncControl,
    params_per_prompt,
    summed_stats,
)
from weir.engine.process_engine import ProcessEngine
from weir.engine.router import least_loaded

__all__ = ["LocalReplicas"]


class LocalReplicas(FromSubmitMany, SyncControl):
    """The `Engine` protocol (and the blocking control API the loop uses) over `replicas`.

    Args:
        replicas: started engines (`ProcessEngine`s; any object with their methods will do), all
            holding the same weights and version.
        seed: seeds the stream of request seeds (see the module docstring).
    """

    def __init__(self, replicas: Sequence[ProcessEngine], *, seed: int = 0) -> None:
        if not replicas:
            raise ValueError("LocalReplicas needs at least one engine")
        self.replicas = list(replicas)
        first = self.replicas[0]
        self.version: int = first.version
        self.vocab_size: int = first.vocab_size
        self.max_seq_len: int = first.max_seq_len
        self.max_batch_size: int = first.max_batch_size
        self.eos_token_ids: list[int] = first.eos_token_ids
        self.pad_token_id: int = first.pad_token_id
        self.dtype: torch.dtype = first.dtype
        self.device: torch.device = first.device
        self.outstanding = [0] * len(self.replicas)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="weir-replicas")

    # -- generation --------------------------------------------------------------------------------

    def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Future[list[Completion]]]:
        """As `TorchEngine.submit_many`: one future per prompt. Each prompt goes to the least
        loaded replica; the prompts one replica receives are admitted there together."""
        params = params_per_prompt(params, len(prompts))
        groups: dict[int, list[int]] = {}
        seeded: list[SamplingParams] = []
        with self._lock:
            for k, sp in enumerate(params):
                if sp.seed is None:
                    sp = dataclasses.replace(sp, seed=self._rng.getrandbits(64))
                seeded.append(sp)
                i = least_loaded(self.outstanding)
                self.outstanding[i] += 1
                groups.setdefault(i, []).append(k)
        futures: list[Future[list[Completion]] | None] = [None] * len(prompts)
        for i, ks in groups.items():
            try:
                sent = self.replicas[i].submit_many(
                    [prompts[k] for k in ks], [seeded[k] for k in ks]
                )
            except BaseException:
                with self._lock:
                    self.outstanding[i] -= len(ks)
                raise
            for k, fut in zip(ks, sent, strict=True):
                futures[k] = self._relay(i, fut)
        return futures  # type: ignore[return-value]

    def _relay(self, i: int, inner: Future) -> Future:
        """A future that ends as `inner` does, once replica `i`'s count has dropped (so a caller
        woken by it sees the count without this prompt)."""
        outer: Future = Future()

        def done(f: Future) -> None:
            with self._lock:
                self.outstanding[i] -= 1
            if outer.done():  # the caller cancelled it
                return
            if f.cancelled():
                outer.cancel()
            elif f.exception() is not None:
                outer.set_exception(f.exception())
            else:
                outer.set_result(f.result())

        inner.add_done_callback(done)
        outer.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)
        return outer

    # -- every replica at once ---------------------------------------------------------------------

    def _each(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every replica, at once; their results in replica order. The first
        error is raised once all have returned."""
        futures = [self._pool.submit(getattr(r, method), *args) for r in self.replicas]
        errors = [f.exception() for f in futures]
        for err in errors:
            if err is not None:
                raise err
        return [f.result() for f in futures]

    def update_weights_sync(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Every replica copies `named_tensors` into its buffers and loads them; returns once all
        have (then `version` is set)."""
        tensors = list(named_tensors)
        self._each("update_weights_sync", tensors, version)
        self.version = version

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        await asyncio.to_thread(self.update_weights_sync, named_tensors, version)

    def pause_sync(self) -> None:
        self._each("pause_sync")

    def resume_sync(self) -> None:
        self._each("resume_sync")

    def abort_sync(self) -> None:
        self._each("abort_sync")

    def drain_sync(self, timeout: float | None = None) -> bool:
        """True once no replica has a request running, False if one still had after `timeout`
        seconds (the replicas wait at the same time)."""
        return all(self._each("drain_sync", timeout))

    def sleep_sync(self, offload_weights: bool = False) -> None:
        self._each("sleep_sync", offload_weights)

    def wake_sync(self, update_follows: bool = False) -> None:
        self._each("wake_sync", update_follows)

    def check_fits(self, prompt_len: int, n: int, max_new_tokens: int) -> None:
        self.replicas[0].check_fits(prompt_len, n, max_new_tokens)

    def stats(self) -> dict[str, float]:
        """Every counter summed over the replicas, except ``busy_s``: their mean (a fraction of
        wall time when divided by it, as for one engine). ``replicas`` says how many."""
        return summed_stats(self._each("stats")) | {"replicas": float(len(self.replicas))}

    def state_dict(self) -> dict[str, Any]:
        """The seed stream and every replica's state (its own stream, its version), by index."""
        return {"rng": self._rng.getstate(), "replicas": self._each("state_dict")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["replicas"]
        if len(saved) != len(self.replicas):
            raise ValueError(
                f"the checkpoint holds the state of {len(saved)} engine replicas and this run has "
                f"{len(self.replicas)}: resume with engine.replicas={len(saved)}"
            )
        self._rng.setstate(state["rng"])
        for r, s in zip(self.replicas, saved, strict=True):
            r.load_state_dict(s)
        self.version = self.replicas[0].version

    # -- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Close every replica (each aborts what is in flight). Idempotent."""
        for r in self.replicas:
            r.close()
        self._pool.shutdown(wait=False)

    stop = close

    def __enter__(self) -> LocalReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
