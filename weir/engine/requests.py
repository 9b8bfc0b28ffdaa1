"""A request in the torch engine: its prompt, sampling parameters, the future its completions resolve,
and the helpers that settle futures safely from the engine thread."""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from typing import Any

from weir.engine.base import Completion, SamplingParams

__all__ = ["Request", "expand_versions", "set_exception", "set_result"]


class Request:
    __slots__ = (
        "prompt",
        "params",
        "future",
        "seed",
        "results",
        "remaining",
        "greedy",
        "filtered",
        "vision",
    )

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        future: Future,
        seed: int,
        vision: Any = None,
    ):
        self.prompt = prompt
        self.vision = vision  # the prompt's pixel inputs (weir.data.vision.VisionInputs) or None
        self.params = params
        self.future = future
        self.seed = seed
        self.results: list[Completion | None] = [None] * params.n
        self.remaining = params.n
        self.greedy = params.temperature == 0.0
        self.filtered = False  # set at admission (needs the vocabulary size)

    def finish_sample(self, index: int, completion: Completion) -> None:
        if self.results[index] is not None:
            return
        self.results[index] = completion
        self.remaining -= 1
        if self.remaining == 0:
            set_result(self.future, self.results)

    def abort_unfinished(self) -> None:
        for i, r in enumerate(self.results):
            if r is None:
                self.finish_sample(i, Completion([], [], [], "abort"))


def set_result(fut: Future, value: Any) -> None:
    try:
        if not fut.done():
            fut.set_result(value)
    except InvalidStateError:  # cancelled concurrently
        pass


def set_exception(fut: Future, exc: BaseException) -> None:
    try:
        if not fut.done():
            fut.set_exception(exc)
    except InvalidStateError:
        pass


def expand_versions(changes: list[tuple[int, int]], n: int) -> list[int]:
    out: list[int] = []
    for i, (start, version) in enumerate(changes):
        end = changes[i + 1][0] if i + 1 < len(changes) else n
        end = min(end, n)
        if end > start:
            out.extend([version] * (end - start))
    return out
