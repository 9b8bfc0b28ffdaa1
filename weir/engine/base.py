"""The engine contract: what a rollout asks for (`SamplingParams`), what it gets back (`Completion`),
and the async `Engine` protocol every implementation (torch, vLLM, SGLang) satisfies.

Log-prob convention (the trainer must use the same one)
-------------------------------------------------------
For each generated token the engine reports

    logprobs[t] = log_softmax(logits_t / T)[token_t]        over the full vocabulary,

with ``T = temperature``, and ``T = 1`` when ``temperature == 0`` (greedy decoding reports the model's
raw log-probs). Top-k and top-p only restrict which tokens may be *sampled*; they do not renormalise
the reported log-prob. The trainer therefore recomputes log-probs as ``log_softmax(logits / T)`` with
the same temperature and no top-k/top-p, and the two agree up to floating point.

When top-k or top-p truncate the distribution, the token was drawn from the renormalised truncated
distribution, and an engine that can says so: ``sampled_logprobs[t] = logprobs[t] - log Z_t`` with
``Z_t`` the probability mass the filters kept at step t. That is the behaviour policy importance
corrections (TIS, decoupled PPO) must weigh against (``algo.behavior_logprobs``).

Versions
--------
Every generated token records the engine's weight ``version`` at the moment it was produced. A
response that was in flight while weights were updated carries tokens of both versions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class SamplingParams:
    """How to sample one request's `n` completions.

    - ``temperature == 0`` is greedy (argmax); its log-probs are the raw ones (T = 1).
    - ``top_k == 0`` and ``top_p == 1.0`` switch those filters off.
    - The engine's EOS ids always stop; ``stop_token_ids`` adds more. A stop token that is emitted is
      included in the completion (with its log-prob and version).
    - ``seed``: when set, this request's samples are reproducible regardless of how the request was
      batched with others (each sample draws from its own counter-based stream keyed by the seed and
      the sample index). When None, the engine derives a seed from its own seed and the submission
      order.
    - ``keep_kv``: a hint that a later request will continue this prompt + completion (the next turn
      of a multi-turn episode). The torch engine then keeps the KV of a completion that ends with a
      stop token, and the request whose prompt extends it reuses that KV instead of prefilling the
      conversation again (`weir.engine.prefix_cache`); other engines ignore it (vLLM and SGLang
      cache prefixes themselves). It never changes what is sampled.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)  # eos is always a stop
    seed: int | None = None
    keep_kv: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be >= 0, got {self.max_new_tokens}"
            )


@dataclass
class Completion:
    """One sampled response. `token_ids`, `logprobs` and `versions` have one entry per generated
    token, the stop token included when one was emitted.

    finish_reason: "stop" (a stop/EOS token was emitted), "length" (max_new_tokens or the context
    limit) or "abort" (ended by `abort()`; the tokens so far are kept).
    sampled_logprobs: log-probs under the top-k/top-p truncated distribution the tokens were drawn
    from; None when no filter applied (then they equal `logprobs`).
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    sampled_logprobs: list[float] | None = None
    routed_experts: torch.Tensor | None = None
    """With routing recorded (`algo.routing_replay`, an MoE model): the experts each MoE layer
    picked for every token the engine ran, ``[len(prompt) + len(token_ids) - 1, layers, k]``
    (prompt and generated tokens but the last, which was never fed back; `weir.data.moe_routing`)."""


@runtime_checkable
class Engine(Protocol):
    """An inference engine with many requests in flight.

    ``generate`` returns the `n` completions of one prompt. ``update_weights`` loads new weights
    between decode steps and sets ``version``; ``pause`` stops decoding between steps (requests in
    flight keep their state), ``resume`` continues it, ``abort`` ends every request in flight now with
    finish_reason "abort", ``drain`` lets the requests in flight finish while new ones wait (until
    ``resume``) and returns True once none is in flight, or False when `timeout` seconds passed
    first (those still running keep running; new ones still wait for ``resume``).
    """

    version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]: ...

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def abort(self) -> None: ...

    async def drain(self, timeout: float | None = None) -> bool: ...


class SyncControl:
    """The Engine protocol's async `pause` / `resume` / `abort` / `drain` for an engine whose
    control is blocking (`pause_sync`, `resume_sync`, `abort_sync`, `drain_sync`): pause, abort and
    drain wait for the decode loop, so they run in a worker thread and the event loop keeps serving;
    resume only signals, so it runs in place."""

    async def pause(self) -> None:
        await asyncio.to_thread(self.pause_sync)

    async def resume(self) -> None:
        self.resume_sync()

    async def abort(self) -> None:
        await asyncio.to_thread(self.abort_sync)

    async def drain(self, timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self.drain_sync, timeout)


def params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """`submit_many`'s `params` as one `SamplingParams` per prompt: one object (or None, the
    defaults) for all `count` prompts, or a sequence of exactly `count`."""
    if params is None or isinstance(params, SamplingParams):
        return [params if params is not None else SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params


def summed_stats(each: list[dict[str, float]]) -> dict[str, float]:
    """Several engines' `stats()` as one: every counter summed, except ``busy_s``, their mean (so
    that busy time over wall time stays a fraction, as for one engine)."""
    total: dict[str, float] = {}
    for s in each:
        for k, v in s.items():
            total[k] = total.get(k, 0.0) + float(v)
    if "busy_s" in total:
        total["busy_s"] /= len(each)
    return total


class FromSubmitMany:
    """`submit`, `generate_many` and the async `generate` of an engine whose one way in is
    ``submit_many(prompts, params)`` (one future per prompt)."""

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> Future[list[Completion]]:
        return self.submit_many([prompt_ids], params)[0]  # type: ignore[attr-defined]

    def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[list[Completion]]:
        return [f.result() for f in self.submit_many(prompts, params)]  # type: ignore[attr-defined]

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> list[Completion]:
        return await asyncio.wrap_future(self.submit(prompt_ids, params))
