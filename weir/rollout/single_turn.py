"""The default rollout function: one prompt, `n` sampled responses, each scored by the reward."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from weir.data.sample import Group, Sample, Status
from weir.engine.base import Engine, SamplingParams
from weir.rollout.rewards import score
from weir.telemetry.timeline import async_span

_rollout_ids = itertools.count()
FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass
class RolloutContext:
    """What a rollout function may use: the engine, the tokenizer, sampling, the reward and encoding.

    `encode(row) -> prompt_ids` applies the configured chat template and length limit;
    `encode_vision(row) -> (prompt_ids, VisionInputs | None)` replaces it for a vision-language
    model (the processor's ids and pixels, `weir.data.vision`).
    """

    engine: Engine
    tokenizer: Any
    sampling: SamplingParams
    reward_fn: Callable
    encode: Callable[[dict], list[int]]
    reward_timeout_s: float | None = 30.0
    extras: dict[str, Any] = field(default_factory=dict)
    encode_vision: Callable[[dict], tuple[list[int], Any]] | None = None
    placeholder_ids: frozenset[int] = frozenset()
    """A vision-language model's image/video placeholder ids: a response that emits one stops
    there and fails (it cannot be trained: no pixels stand behind it); `sampling` stops on them."""

    def encode_prompt(self, row: dict) -> tuple[list[int], Any]:
        """Prompt ids and pixel inputs (None for a text-only prompt or model) of `row`."""
        if self.encode_vision is not None:
            return self.encode_vision(row)
        return self.encode(row), None

    async def generate(self, prompt_ids: list[int], vision: Any = None) -> list[Any]:
        """The engine's completions of one prompt under `sampling`, with its pixels if it has any."""
        if vision is None:
            return await self.engine.generate(prompt_ids, self.sampling)
        return await self.engine.generate(prompt_ids, self.sampling, vision=vision)

    def with_sampling(self, **changes: Any) -> RolloutContext:
        return replace(self, sampling=replace(self.sampling, **changes))


async def rollout(ctx: RolloutContext, row: dict) -> Group:
    """Generate `ctx.sampling.n` responses to `row`'s prompt and score each with the reward function."""
    prompt_ids, vision = ctx.encode_prompt(row)
    key = next(_rollout_ids)
    with async_span("generate", key, prompt=row.get("_index")):
        completions = await ctx.generate(prompt_ids, vision)
    samples = [
        Sample(
            prompt_ids=prompt_ids,
            response_ids=list(c.token_ids),
            rollout_logprobs=list(c.logprobs),
            behavior_logprobs=None if c.sampled_logprobs is None else list(c.sampled_logprobs),
            routed_experts=c.routed_experts,
            versions=list(c.versions),
            status=FINISH_STATUS.get(c.finish_reason, Status.COMPLETED),
            index=i,
            row=row,
            response_text=ctx.tokenizer.decode(c.token_ids, skip_special_tokens=True),
            vision=vision,
        )
        for i, c in enumerate(completions)
    ]
    if ctx.placeholder_ids:
        for s in samples:
            if ctx.placeholder_ids.intersection(s.response_ids):
                s.status = Status.FAILED
                s.error = "the response emitted an image placeholder token (no pixels behind it)"
    with async_span("reward", key, cat="reward"):
        await asyncio.gather(
            *(score(ctx.reward_fn, s, row, timeout_s=ctx.reward_timeout_s) for s in samples)
        )
    return Group(samples=samples, row=row)
