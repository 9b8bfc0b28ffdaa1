"""A generative judge: an LLM behind any OpenAI-compatible chat endpoint (``weir serve``, vLLM, a
hosted API) reads a rendered prompt and answers with a score.

    reward = (x - min_score) / (max_score - min_score)   if normalize   else x

where x is the number the `pattern` finds in the judge's reply (its first group when it has one,
the last match when there are several), refused when outside [min_score, max_score].

Each call: the cache is consulted (key: model, messages, temperature, max_tokens; in memory and,
with `cache_path`, in a JSON-lines file that later runs reuse); otherwise at most
`max_concurrency` requests are in flight per event loop, each bounded by `timeout_s`, and transport
errors, timeouts, 429 and 5xx are retried up to `retries` times with exponential backoff
(``backoff_s * 2**attempt``). A 4xx other than 429, or a reply without a score in range, fails the
sample at once (`score` contains and counts it). Needs the ``openai`` package (``pip install
weir[judge]``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from string import Formatter
from typing import Any

from weir.data.sample import Sample

__all__ = ["Judge", "judge", "DEFAULT_TEMPLATE", "DEFAULT_PATTERN", "check_judge"]

DEFAULT_TEMPLATE = (
    "Rate the response to the question on a scale from 0 to 10, where 10 is a fully correct "
    "answer.\n\nQuestion:\n{prompt}\n\nResponse:\n{response}\n\n"
    "Reply with the score only, as 'Score: <number>'."
)
DEFAULT_PATTERN = r"(-?\d+(?:\.\d+)?)"


class JudgeError(Exception):
    """The judge's reply held no usable score, or the endpoint refused the request."""


def check_judge(template: str = DEFAULT_TEMPLATE, pattern: str = DEFAULT_PATTERN, **_: Any) -> None:
    """Refuse a template that does not parse or a pattern that does not compile, up front."""
    try:
        fields = [f for _, f, _, _ in Formatter().parse(template) if f is not None]
    except ValueError as err:
        raise ValueError(
            f"judge template does not parse ({err}); escape literal braces as {{{{ }}}}"
        ) from None
    if any(f == "" or f.isdigit() for f in fields):
        raise ValueError("judge template fields must be named, e.g. {prompt}, {response}, {answer}")
    try:
        re.compile(pattern)
    except re.error as err:
        raise ValueError(f"judge pattern {pattern!r} is not a valid regex ({err})") from None
    try:
        import openai  # noqa: F401
    except ImportError:
        raise ValueError(
            "the judge reward needs the openai package: pip install 'weir[judge]'"
        ) from None


class Judge:
    """One configured judge: endpoint, template, parse rule, limits and cache (see module doc)."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        template: str = DEFAULT_TEMPLATE,
        system: str | None = None,
        pattern: str = DEFAULT_PATTERN,
        min_score: float = 0.0,
        max_score: float = 10.0,
        normalize: bool = True,
        temperature: float = 0.0,
        max_tokens: int = 64,
        max_concurrency: int = 8,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        cache_path: str | None = None,
    ) -> None:
        check_judge(template, pattern)
        if max_score <= min_score:
            raise ValueError(f"judge needs min_score < max_score, got {min_score} and {max_score}")
        self.base_url, self.model = base_url, model
        self.api_key = os.environ.get(api_key_env) or "EMPTY"
        self.template, self.system, self.pattern = template, system, re.compile(pattern)
        self.min_score, self.max_score, self.normalize = min_score, max_score, normalize
        self.temperature, self.max_tokens = temperature, max_tokens
        self.max_concurrency, self.timeout_s = max_concurrency, timeout_s
        self.retries, self.backoff_s = retries, backoff_s
        self.cache_path = Path(cache_path) if cache_path else None
        self.cache: dict[str, str] = {}
        self.requests = 0  # HTTP requests sent, retries included
        self.cache_hits = 0
        self._file_lock = threading.Lock()
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )
        if self.cache_path is not None and self.cache_path.exists():
            for line in self.cache_path.read_text().splitlines():
                if line.strip():
                    entry = json.loads(line)
                    self.cache[entry["key"]] = entry["reply"]

    # -- rendering and parsing
    def messages(self, row: Mapping[str, Any], response: str) -> list[dict[str, str]]:
        """The chat messages for one sample: `template` filled with the row's fields, ``response``
        and ``prompt`` (the row's ``prompt`` field, messages joined by newlines)."""
        prompt = row.get("prompt", "")
        if not isinstance(prompt, str):
            prompt = "\n".join(str(m.get("content", "")) for m in prompt)
        fields = {**row, "prompt": prompt, "response": response}
        try:
            content = self.template.format(**fields)
        except KeyError as err:
            raise ValueError(
                f"judge template names {err} but the row has only {sorted(fields)}"
            ) from None
        out = [{"role": "system", "content": self.system}] if self.system else []
        return [*out, {"role": "user", "content": content}]

    def parse(self, reply: str) -> float:
        """The score in `reply` (last match of `pattern`), normalized; JudgeError if none in range."""
        matches = list(self.pattern.finditer(reply))
        if not matches:
            raise JudgeError(
                f"judge reply holds no score matching {self.pattern.pattern!r}: {reply[:200]!r}"
            )
        m = matches[-1]
        try:
            x = float(m.group(1) if m.groups() else m.group(0))
        except ValueError:
            raise JudgeError(f"judge score {m.group(0)!r} is not a number") from None
        if not self.min_score <= x <= self.max_score:
            raise JudgeError(f"judge score {x} is outside [{self.min_score}, {self.max_score}]")
        if self.normalize:
            return (x - self.min_score) / (self.max_score - self.min_score)
        return x

    def key(self, messages: list[dict[str, str]]) -> str:
        blob = json.dumps([self.model, messages, self.temperature, self.max_tokens], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    # -- calling
    def _client(self) -> tuple[Any, asyncio.Semaphore]:
        """An AsyncOpenAI client and a semaphore for the running loop (both are loop-bound)."""
        from openai import AsyncOpenAI

        loop = asyncio.get_running_loop()
        with self._file_lock:
            if loop not in self._per_loop:
                client = AsyncOpenAI(
                    base_url=self.base_url,
                    api_key=self.api_key,
                    max_retries=0,
                    timeout=self.timeout_s,
                )
                self._per_loop[loop] = (client, asyncio.Semaphore(self.max_concurrency))
            return self._per_loop[loop]

    async def reply(self, messages: list[dict[str, str]]) -> tuple[str, bool]:
        """The judge's reply text and whether it came from the cache."""
        import openai

        key = self.key(messages)
        if key in self.cache:
            self.cache_hits += 1
            return self.cache[key], True
        client, sem = self._client()
        retryable = (
            openai.APIConnectionError,  # includes APITimeoutError
            openai.RateLimitError,
            openai.InternalServerError,
            asyncio.TimeoutError,
        )
        for attempt in range(self.retries + 1):
            try:
                async with sem:
                    self.requests += 1
                    resp = await asyncio.wait_for(
                        client.chat.completions.create(
                            model=self.model,
                            messages=messages,
                            temperature=self.temperature,
                            max_tokens=self.max_tokens,
                        ),
                        self.timeout_s,
                    )
                text = resp.choices[0].message.content or ""
                break
            except retryable as err:
                if attempt == self.retries:
                    raise JudgeError(
                        f"judge endpoint {self.base_url} failed {attempt + 1} time(s): "
                        f"{type(err).__name__}: {err}"
                    ) from None
                await asyncio.sleep(self.backoff_s * 2**attempt)
            except openai.APIStatusError as err:
                raise JudgeError(
                    f"judge endpoint {self.base_url} refused the request ({err.status_code}): {err}"
                ) from None
        self.cache[key] = text
        if self.cache_path is not None:
            with self._file_lock, self.cache_path.open("a") as f:
                f.write(json.dumps({"key": key, "reply": text}) + "\n")
        return text, False

    async def __call__(self, row: Mapping[str, Any], response: str) -> dict[str, Any]:
        text, cached = await self.reply(self.messages(row, response))
        return {"reward": self.parse(text), "judge_reply": text, "judge_cached": cached}


_JUDGES: dict[str, Judge] = {}
_JUDGES_LOCK = threading.Lock()


def get_judge(**options: Any) -> Judge:
    """The process's Judge for these options (one per distinct configuration, so its cache,
    concurrency limit and counters are shared by every call)."""
    key = json.dumps(options, sort_keys=True, default=str)
    with _JUDGES_LOCK:
        if key not in _JUDGES:
            _JUDGES[key] = Judge(**options)
        return _JUDGES[key]


async def judge(
    sample: Sample,
    row: Mapping[str, Any],
    *,
    eos_texts: Sequence[str] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Reward from a generative judge; `options` are `Judge`'s (base_url and model required).

    Returns ``{"reward", "judge_reply", "judge_cached"}``."""
    from weir.rollout.rewards import DEFAULT_EOS_TEXTS, strip_eos

    response = strip_eos(sample.response_text, eos_texts or DEFAULT_EOS_TEXTS)
    return await get_judge(**options)(row, response)
