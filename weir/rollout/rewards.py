"""Reward functions and the safe way to call them.

A reward function has the signature ``(sample: Sample, row: dict) -> float | dict`` and may be
sync or async. A dict result must hold ``"reward"`` and may carry components and parse results
(they land in ``sample.reward_info``). The ground truth is ``row[answer_key]`` (``"answer"`` by
default); every built-in takes `answer_key` as a keyword, so ``functools.partial`` or
``get_reward("math", answer_key="solution")`` retargets it.

Built-ins (`REWARDS`): ``exact_match``, ``numeric``, ``math`` (math-verify), ``format``;
``code_tests`` / ``code_io`` (programs run in the sandbox, `weir.rollout.code_rewards`);
``reward_model`` (weir.rollout.reward_models), ``judge`` (weir.rollout.judge) and ``combine``
(weir.rollout.combine).
`length_penalty` wraps any reward with DAPO's overlong penalty. `score` calls a reward function
and contains its failures, so one bad sample never takes a rollout down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import logging
import math as _math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from numbers import Real
from typing import Any

from weir.data.sample import Sample, Status
from weir.plugins import resolve
from weir.rollout.code_rewards import code_io, code_tests
from weir.rollout.combine import combine
from weir.rollout.judge import judge
from weir.rollout.reward_models import reward_model

__all__ = [
    "REWARDS",
    "DEFAULT_EOS_TEXTS",
    "DEFAULT_FORMAT_PATTERN",
    "exact_match",
    "numeric",
    "math",
    "format",
    "length_penalty",
    "score",
    "get_reward",
    "strip_eos",
    "extract_number",
    "answer_after_hashes",
    "gold_final_answer",
    "reward_name",
]

RewardFn = Callable[..., Any]

DEFAULT_EOS_TEXTS: tuple[str, ...] = (
    "<|end|>",
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<eos>",
    "</s>",
)


# ----------------------------------------------------------------------------------- helpers


def strip_eos(text: str, eos_texts: Sequence[str] = DEFAULT_EOS_TEXTS) -> str:
    """`text` without surrounding whitespace and without trailing end-of-sequence markers."""
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for eos in eos_texts:
            if eos and text.endswith(eos):
                text = text[: -len(eos)].rstrip()
                changed = True
    return text


def _gold(row: Mapping[str, Any], answer_key: str) -> str:
    if answer_key not in row:
        raise ValueError(
            f"row has no ground-truth field {answer_key!r} (keys: {sorted(row)}); "
            "set answer_key to the field that holds the answer"
        )
    value = row[answer_key]
    if value is None:
        raise ValueError(f"row field {answer_key!r} (the ground truth) is None")
    return str(value)


def answer_line(text: str) -> str:
    """The rest of the line after the last ``####`` (the whole text when there is none)."""
    if "####" not in text:
        return text
    return text.rsplit("####", 1)[1].split("\n", 1)[0]


def answer_after_hashes(text: str) -> str:
    """What a response answers on its last ``####`` line (GSM8K's and verl's convention): the
    number right after ``####`` when the line starts with one (``#### $1,200 dollars, from step 3``
    answers 1200; the words and numbers after it are not the answer), else the rest of the line
    (an expression such as ``#### x^2 + 1``)."""
    line = answer_line(text)
    lead = _LEADING_NUMBER.match(_latex_to_plain(line))
    if lead is None:
        return line
    sign = "-" if lead.group("sign") else ""
    return sign + lead.group("num").replace(",", "")


def gold_final_answer(gold: str) -> str:
    """The final answer of a gold string: the line after the last ``####`` (GSM8K) if present,
    stripped, with thousands separators removed from numbers."""
    gold = answer_line(gold).strip()
    return _THOUSANDS.sub("", gold)


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")

# An unsigned number: 1,234,567 | 1234 | with optional decimals, or a tight fraction 3/4.
_NUMBER = re.compile(
    r"(?<![\w.,])"
    r"(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
    r"(?P<dec>\.\d+)?"
    r"(?:/(?P<den>\d+)(?![\d.]))?"
)
# A line that opens with a number: optional "\\(" or "$", a sign, the number as `_NUMBER` reads it.
_LEADING_NUMBER = re.compile(
    r"\s*(?:\\\(|\$)?\s*(?P<sign>[-\u2212])?\s*\$?\s*"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+(?![\d.]))?)"
)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.,]+)\s*\}\s*\{\s*(-?[\d.,]+)\s*\}")
_ANSWER_IS = re.compile(
    r"(?:\banswer\b\s*(?:is|was|would be|will be|=|:)?|^\s*A\s*[:=])\s*:?",
    re.IGNORECASE | re.MULTILINE,
)
_MINUS = "-\u2212"
# **bold** / __bold__ around an answer ("**Answer: 18**"): math-verify would read "18**"
_MARKDOWN_BOLD = re.compile(r"(?:\*\*|__)(.+?)(?:\*\*|__)")


def _numbers(text: str) -> list[Fraction]:
    """Every number in `text`, in order; a '-' is a sign unless it follows a digit or bracket."""
    out = []
    for m in _NUMBER.finditer(text):
        value = Fraction(m.group("int").replace(",", "") + (m.group("dec") or ""))
        if m.group("den") is not None:
            den = int(m.group("den"))
            if den == 0:
                continue
            value /= den
        j = m.start() - 1
        if j >= 0 and text[j] == "$":
            j -= 1
        while j >= 0 and text[j] in " \t":
            j -= 1
        if j >= 0 and text[j] in _MINUS:
            k = j - 1
            while k >= 0 and text[k] in " \t":
                k -= 1
            if k < 0 or text[k] == "$" or not (text[k].isdigit() or text[k] in ")]}"):
                value = -value
        out.append(value)
    return out


def _boxed_contents(text: str) -> list[str]:
    out = []
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end() : i - 1])
    return out


def _latex_to_plain(text: str) -> str:
    text = text.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\$", "$")
    return _FRAC.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text)


def extract_number(text: str) -> Fraction | None:
    """The final numeric answer of a response, or None.

    In order of preference: the first number after the last ``####``; the first number in the last
    ``\\boxed{...}`` (``\\frac{a}{b}`` understood); the first number after the last "answer is" /
    "answer:" / a line starting "A:"; else the last number in the text. Numbers may carry
    thousands separators (``1,234``), a sign, decimals, a ``$`` and a tight fraction (``3/4``).
    """
    text = _latex_to_plain(text)
    if "####" in text:
        nums = _numbers(answer_line(text))
        if nums:
            return nums[0]
    boxed = _boxed_contents(text)
    if boxed:
        nums = _numbers(_latex_to_plain(boxed[-1]))
        if nums:
            return nums[0]
    anchors = list(_ANSWER_IS.finditer(text))
    if anchors:
        nums = _numbers(text[anchors[-1].end() :].split("\n", 1)[0])
        if nums:
            return nums[0]
    nums = _numbers(text)
    return nums[-1] if nums else None


def _plain_number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def _close(a: Fraction, b: Fraction, rel_tol: float) -> bool:
    """Integers compare exactly; otherwise within `rel_tol` (so 0.333333 matches 1/3)."""
    if a == b:
        return True
    if a.denominator == 1 and b.denominator == 1:
        return False
    return abs(a - b) <= rel_tol * max(1, abs(b))


# ---------------------------------------------------------------------------------- built-ins


def exact_match(
    sample: Sample,
    row: Mapping[str, Any],
    *,
    answer_key: str = "answer",
    eos_texts: Sequence[str] = DEFAULT_EOS_TEXTS,
    case_sensitive: bool = True,
) -> float:
    """1.0 if the stripped response (without trailing EOS text) equals the stripped answer."""
    pred = strip_eos(sample.response_text, eos_texts)
    gold = _gold(row, answer_key).strip()
    if not case_sensitive:
        pred, gold = pred.casefold(), gold.casefold()
    return 1.0 if pred == gold else 0.0


def numeric(
    sample: Sample,
    row: Mapping[str, Any],
    *,
    answer_key: str = "answer",
    eos_texts: Sequence[str] = DEFAULT_EOS_TEXTS,
    rel_tol: float = 1e-6,
) -> dict[str, Any]:
    """1.0 if the response's final number (see `extract_number`) equals the gold number
    (integers exactly, non-integers within `rel_tol`).

    The gold may be a number or a GSM8K solution ending in ``#### N``. Returns
    ``{"reward", "pred", "gold"}`` (pred None when the response holds no number). A gold without
    a number raises ValueError (a data error, contained by `score`).
    """
    gold_num = extract_number(gold_final_answer(_gold(row, answer_key)))
    if gold_num is None:
        raise ValueError(f"the ground truth {row[answer_key]!r} holds no number")
    pred = extract_number(strip_eos(sample.response_text, eos_texts))
    ok = pred is not None and _close(pred, gold_num, rel_tol)
    return {
        "reward": 1.0 if ok else 0.0,
        "pred": None if pred is None else _plain_number(pred),
        "gold": _plain_number(gold_num),
    }


_log = logging.getLogger(__name__)


class _TimeoutNotice(logging.Filter):
    """math-verify warns "Timeout is disabled ..." (to stderr, through logging's last resort) the
    first time each of its modules runs without its own timeout, which `_mv_timeout` turns off in
    reward threads; `score`'s timeout bounds those calls. This filter drops that record and says it
    once per process in weir's log, at debug level, instead."""

    said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Timeout is disabled"):
            return True
        if not _TimeoutNotice.said:
            _TimeoutNotice.said = True
            _log.debug(
                "math-verify runs without its own timeout in reward threads (signal.alarm works only "
                "in the main thread); reward.timeout_s bounds each call"
            )
        return False


_TIMEOUT_NOTICE = _TimeoutNotice()


def _route_math_verify_notices() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _TIMEOUT_NOTICE not in logger.filters:
            logger.addFilter(_TIMEOUT_NOTICE)


def _mv_timeout(seconds: int | None) -> int | None:
    # math-verify's timeouts use signal.alarm, which only works in the main thread; elsewhere
    # (e.g. under asyncio.to_thread) they must be off, and `score`'s timeout bounds the call.
    return seconds if threading.current_thread() is threading.main_thread() else None


def math(
    sample: Sample,
    row: Mapping[str, Any],
    *,
    answer_key: str = "answer",
    eos_texts: Sequence[str] = DEFAULT_EOS_TEXTS,
    timeout_seconds: int = 5,
) -> dict[str, Any]:
    """1.0 if math-verify finds the response's answer equivalent to the gold.

    Gold: the part after ``####`` if present (GSM8K), parsed as ``\\boxed{gold}`` (or as is).
    Response: with a ``####`` line, what `answer_after_hashes` reads there (GSM8K's and verl's
    convention: the number right after ``####``; words after it, "in total, from step 1", and notes
    on later lines are not the answer), else the whole text (math-verify prefers ``\\boxed{}`` and
    the last expression). When math-verify parses nothing on either side, the `numeric` extraction
    decides. Returns ``{"reward", "pred", "gold", "method"}``.
    """
    from math_verify import parse, verify

    _route_math_verify_notices()
    t = _mv_timeout(timeout_seconds)
    gold_text = gold_final_answer(_gold(row, answer_key))
    response = _MARKDOWN_BOLD.sub(r"\1", strip_eos(sample.response_text, eos_texts))
    span = answer_after_hashes(response) if "####" in response else response
    gold_parsed: list[Any] = []
    if gold_text and "$" not in gold_text and "\\boxed" not in gold_text:
        # a bare gold answer is the whole expression: boxing it stops math-verify from taking
        # only a piece of it (plain "1+x^2" parses as 1)
        gold_parsed = parse("\\boxed{" + gold_text + "}", parsing_timeout=t)
    if not gold_parsed and gold_text:
        gold_parsed = parse(gold_text, parsing_timeout=t)
    pred_parsed = parse(span, parsing_timeout=t) if span.strip() else []
    if gold_parsed and pred_parsed:
        ok = bool(verify(gold_parsed, pred_parsed, timeout_seconds=t))
        return {
            "reward": 1.0 if ok else 0.0,
            "pred": str(pred_parsed[-1]),
            "gold": str(gold_parsed[-1]),
            "method": "math_verify",
        }
    result = numeric(sample, {"answer": gold_text}, eos_texts=eos_texts)
    result["method"] = "numeric"
    return result


DEFAULT_FORMAT_PATTERN = r"(?:####|\\boxed\{|\banswer\b|^\s*A\s*:)[^\n]*\d[^\n]*\Z"


def format(
    sample: Sample,
    row: Mapping[str, Any],
    *,
    pattern: str = DEFAULT_FORMAT_PATTERN,
    flags: int = re.IGNORECASE | re.MULTILINE,
    eos_texts: Sequence[str] = DEFAULT_EOS_TEXTS,
) -> float:
    """1.0 if ``re.search(pattern, response)`` matches the stripped response, else 0.0.

    The default pattern asks that the response end with a final-answer line holding a number:
    ``#### 42``, ``\\boxed{42}``, ``The answer is 42`` or ``A: 42``.
    """
    text = strip_eos(sample.response_text, eos_texts)
    return 1.0 if re.search(pattern, text, flags) else 0.0


def length_penalty(
    fn: RewardFn,
    *,
    max_response_tokens: int,
    buffer_tokens: int,
    penalty: float = 1.0,
) -> RewardFn:
    """Wrap `fn` with DAPO's soft overlong penalty on the response length L (tokens):

        p(L) = 0                              if L <= max - buffer
        p(L) = -penalty * (L - (max - buffer)) / buffer    if max - buffer < L <= max
        p(L) = -penalty                       if L > max

    The wrapped reward is ``fn(...)["reward"] + p(L)``, returned as a dict with components
    ``base_reward`` and ``length_penalty``. Works for sync and async `fn`.
    """
    if buffer_tokens <= 0 or max_response_tokens <= buffer_tokens:
        raise ValueError("length_penalty needs 0 < buffer_tokens < max_response_tokens")
    soft_start = max_response_tokens - buffer_tokens

    def combine(sample: Sample, base: Any) -> dict[str, Any]:
        info = _normalize(base, reward_name(fn))
        n = len(sample.response_ids)
        if n <= soft_start:
            p = 0.0
        elif n <= max_response_tokens:
            p = -penalty * (n - soft_start) / buffer_tokens
        else:
            p = -penalty
        return {
            **info,
            "reward": info["reward"] + p,
            "base_reward": info["reward"],
            "length_penalty": p,
        }

    if _is_async(fn):

        async def wrapped_async(sample: Sample, row: Mapping[str, Any]) -> dict[str, Any]:
            return combine(sample, await fn(sample, row))

        wrapped_async.__name__ = f"length_penalty({reward_name(fn)})"
        return wrapped_async

    def wrapped(sample: Sample, row: Mapping[str, Any]) -> dict[str, Any]:
        return combine(sample, fn(sample, row))

    wrapped.__name__ = f"length_penalty({reward_name(fn)})"
    return wrapped


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric": numeric,
    "math": math,
    "format": format,
    "code_tests": code_tests,
    "code_io": code_io,
    "reward_model": reward_model,
    "judge": judge,
    "combine": combine,
}


# ------------------------------------------------------------------------------- calling them


def reward_name(fn: Any) -> str:
    """A readable name for a reward function (unwrapping functools.partial)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _is_async(fn: Any) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004  (an object with an async __call__)
    return call is not None and inspect.iscoroutinefunction(call)


class _RewardFailure(Exception):
    pass


def _normalize(result: Any, name: str) -> dict[str, Any]:
    """``{"reward": float, ...components}`` from a reward function's return value, or raise."""
    if isinstance(result, Mapping):
        if "reward" not in result:
            raise _RewardFailure(
                f"ValueError: reward function {name} returned a dict without 'reward' "
                f"(keys: {sorted(result)})"
            )
        info = dict(result)
        value = result["reward"]
    else:
        info = {}
        value = result
    if not isinstance(value, Real):  # bool counts: True -> 1.0
        raise _RewardFailure(
            f"TypeError: reward function {name} returned {type(value).__name__} {value!r}; "
            "expected a number or a dict with a numeric 'reward'"
        )
    value = float(value)
    if not _math.isfinite(value):
        raise _RewardFailure(
            f"ValueError: reward function {name} returned non-finite reward {value}"
        )
    info["reward"] = value
    return info


_REWARD_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _in_reward_thread(fn: RewardFn, sample: Sample, row: Mapping[str, Any]) -> asyncio.Future:
    """Run a sync reward in weir's own thread pool, not the event loop's default executor: `asyncio.run`
    waits for the default executor's threads on exit, so one hung reward would stall the whole step
    long after its timeout."""
    global _REWARD_POOL
    if _REWARD_POOL is None:
        _REWARD_POOL = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="weir-reward")
    call = functools.partial(contextvars.copy_context().run, fn, sample, row)
    return asyncio.get_running_loop().run_in_executor(_REWARD_POOL, call)


async def score(
    fn: RewardFn,
    sample: Sample,
    row: Mapping[str, Any],
    *,
    timeout_s: float | None = None,
) -> None:
    """Call the reward `fn` on (sample, row) and write ``sample.reward`` / ``sample.reward_info``.

    Sync functions run in a worker thread (``asyncio.to_thread``), async ones are awaited. A dict
    result's keys are merged into ``sample.reward_info``; a number becomes ``{"reward": r}``.

    Failures are contained, never raised: an exception, a timeout, or a non-numeric / non-finite
    reward sets ``sample.status = Status.FAILED``, ``sample.reward = None`` and ``sample.error``
    to ``"RewardError: <type>: <message>"`` (``"RewardError: timeout: ..."`` for a timeout).
    Only cancellation of the calling task propagates. A timed-out sync function cannot be killed:
    its thread runs on in the background, but its result is ignored.
    """
    name = reward_name(fn)
    try:
        call = fn(sample, row) if _is_async(fn) else _in_reward_thread(fn, sample, row)
        if timeout_s is not None:
            result = await asyncio.wait_for(call, timeout_s)
        else:
            result = await call
        if inspect.isawaitable(result):  # a sync wrapper that returned a coroutine
            result = await (
                asyncio.wait_for(result, timeout_s) if timeout_s is not None else result
            )
        info = _normalize(result, name)
    except asyncio.TimeoutError:
        _fail(
            sample, f"RewardError: timeout: reward function {name} took longer than {timeout_s} s"
        )
        return
    except _RewardFailure as e:
        _fail(sample, f"RewardError: {e}")
        return
    except asyncio.CancelledError:
        raise
    except Exception as e:
        _fail(sample, f"RewardError: {type(e).__name__}: {e} (in reward function {name})")
        return
    sample.reward = info["reward"]
    sample.reward_info.update(info)


def _fail(sample: Sample, message: str) -> None:
    sample.status = Status.FAILED
    sample.error = message
    sample.reward = None


def get_reward(spec: str | RewardFn, **kwargs: Any) -> RewardFn:
    """Resolve a reward: a built-in name (see `REWARDS`), a dotted path ``pkg.mod:fn``, or a
    callable; `kwargs` are bound with ``functools.partial``. Unknown kwargs raise ValueError
    naming the parameters the function accepts."""
    fn = resolve(spec, REWARDS, "reward function")
    if not kwargs:
        return fn
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        unknown = sorted(set(kwargs) - set(sig.parameters))
        if unknown:
            accepted = [n for n in sig.parameters if n not in ("sample", "row")]
            raise ValueError(
                f"reward function {reward_name(fn)} has no parameter(s) {unknown}; "
                f"it accepts {accepted}"
            )
    return functools.partial(fn, **kwargs)
