"""A learned reward: a Hugging Face sequence-classification model (``AutoModelForSequenceClassification``
with one label) scores prompt + response.

The reward model has its own tokenizer and chat template: the policy may tokenize differently, so
the RM never sees the policy's ids. It reads the row's prompt (a string or a list of chat messages)
and the decoded response, renders ``[*prompt messages, {"role": "assistant", "content": response}]``
through its own chat template (or joins the texts when it has none), and reads the score of its
single label at the last non-pad token.

Concurrent calls are collected into one forward pass (`MicroBatcher`: up to `batch_size` texts,
waiting at most `max_wait_ms` for a batch to fill), on the RM's own device. One instance per
distinct configuration lives in each process (`reward_model` looks it up), so the reward can be
shipped to Ray reward actors (``cluster.reward_workers``) as a plain function: each actor loads its
own copy once.

    reward = scale * (sigmoid(logit) if sigmoid else logit) + shift
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from weir.data.sample import Sample

__all__ = ["MicroBatcher", "RewardModel", "reward_model", "check_reward_model"]


class _Queue:
    """One event loop's pending items and flush timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: list[tuple[Any, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None


class MicroBatcher:
    """Collects concurrent `submit` calls into batches for `batch_fn(items) -> results`.

    A batch is flushed when it holds `max_batch` items or `max_wait_s` after its first item arrived,
    whichever comes first. `batch_fn` is synchronous and runs in a worker thread, so the event loop
    keeps serving (and collecting) while a batch computes. An exception from `batch_fn` is raised
    in every caller of that batch. Each event loop has its own queue (the async driver's rollout
    loop and an evaluation loop may score at the same time); `batch_fn` must be thread-safe.
    """

    def __init__(
        self, batch_fn: Callable[[list[Any]], list[Any]], max_batch: int, max_wait_s: float
    ):
        if max_batch < 1 or max_wait_s < 0:
            raise ValueError("MicroBatcher needs max_batch >= 1 and max_wait_s >= 0")
        self.batch_fn, self.max_batch, self.max_wait_s = batch_fn, max_batch, max_wait_s
        self.batch_sizes: list[int] = []  # every flushed batch's size, for tests and inspection
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queue] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    async def submit(self, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        with self._lock:
            q = self._queues.get(loop)
            if q is None:
                q = self._queues[loop] = _Queue(loop)
        fut = loop.create_future()
        q.pending.append((item, fut))
        if len(q.pending) >= self.max_batch:
            self._flush(q)
        elif q.timer is None:
            q.timer = loop.call_later(self.max_wait_s, self._flush, q)
        return await fut

    def _flush(self, q: _Queue) -> None:
        if q.timer is not None:
            q.timer.cancel()
            q.timer = None
        batch, q.pending = q.pending[: self.max_batch], q.pending[self.max_batch :]
        if q.pending:
            q.timer = q.loop.call_later(self.max_wait_s, self._flush, q)
        if batch:
            with self._lock:
                self.batch_sizes.append(len(batch))
            q.loop.create_task(self._run(batch))

    async def _run(self, batch: list[tuple[Any, asyncio.Future]]) -> None:
        try:
            results = await asyncio.to_thread(self.batch_fn, [item for item, _ in batch])
        except BaseException as err:  # noqa: BLE001  (handed to every caller of the batch)
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            return
        for (_, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)


def _load_error(path: str, why: str) -> ValueError:
    return ValueError(f"reward model {path!r}: {why}")


DTYPES = ("float32", "bfloat16", "float16")


def check_reward_model(path: str, dtype: str = "float32", device: str = "cpu", **_: Any) -> None:
    """Refuse up front what `RewardModel` cannot score: no config, not one label, an unknown
    dtype or device."""
    import torch
    from transformers import AutoConfig

    if dtype not in DTYPES:
        raise _load_error(path, f"dtype {dtype!r} is not one of {list(DTYPES)}")
    try:
        torch.device(device)
    except RuntimeError:
        raise _load_error(path, f"device {device!r} is not a torch device (cpu, cuda:N)") from None
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise _load_error(
            path, f"cannot read its config ({first}); set path to a model directory"
        ) from None
    if config.num_labels != 1:
        raise _load_error(
            path,
            f"has {config.num_labels} labels; a reward model needs exactly one "
            "(AutoModelForSequenceClassification with num_labels=1)",
        )


class RewardModel:
    """A loaded sequence-classification reward model; `score(texts)` returns one float each."""

    def __init__(
        self,
        path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_length: int = 1024,
        batch_size: int = 16,
        max_wait_ms: float = 5.0,
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_reward_model(path, dtype, device)
        self.path, self.device = path, torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.truncation_side = "left"  # keep the end of the response, which is scored
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=getattr(torch, dtype)
        ).to(self.device)
        self.model.eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.max_length = max_length
        self._lock = threading.Lock()
        self.batcher = MicroBatcher(self.score, batch_size, max_wait_ms / 1000.0)

    def render(self, prompt: str | Sequence[Mapping[str, str]], response: str) -> str:
        """The RM's input text: its chat template over prompt + response, or the two joined."""
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        )
        messages.append({"role": "assistant", "content": response})
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n".join(m["content"] for m in messages)

    def score(self, texts: list[str]) -> list[float]:
        """Raw logits of the single label for each text, in one padded forward pass."""
        import torch

        enc = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            add_special_tokens=False,
            return_tensors="pt",
        ).to(self.device)
        with self._lock, torch.inference_mode():
            logits = self.model(**enc).logits
        return [float(x) for x in logits[:, 0].float().cpu()]


_MODELS: dict[str, RewardModel] = {}
_MODELS_LOCK = threading.Lock()


def _instance(path: str, **options: Any) -> RewardModel:
    key = json.dumps([str(Path(path)), options], sort_keys=True)
    with _MODELS_LOCK:
        if key not in _MODELS:
            _MODELS[key] = RewardModel(path, **options)
        return _MODELS[key]


async def reward_model(
    sample: Sample,
    row: Mapping[str, Any],
    *,
    path: str,
    prompt_key: str = "prompt",
    device: str = "cpu",
    dtype: str = "float32",
    max_length: int = 1024,
    batch_size: int = 16,
    max_wait_ms: float = 5.0,
    sigmoid: bool = False,
    scale: float = 1.0,
    shift: float = 0.0,
    eos_texts: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Reward = ``scale * (sigmoid(logit) if sigmoid else logit) + shift`` of the sequence-
    classification model at `path` on ``row[prompt_key]`` + the response (EOS text stripped).

    Returns ``{"reward", "rm_logit"}``. The model is loaded once per process and configuration;
    concurrent calls share forward passes of up to `batch_size`.
    """
    from weir.rollout.rewards import DEFAULT_EOS_TEXTS, strip_eos

    if prompt_key not in row:
        raise ValueError(f"row has no prompt field {prompt_key!r} (keys: {sorted(row)})")
    rm = _instance(
        path,
        device=device,
        dtype=dtype,
        max_length=max_length,
        batch_size=batch_size,
        max_wait_ms=max_wait_ms,
    )
    text = rm.render(
        row[prompt_key], strip_eos(sample.response_text, eos_texts or DEFAULT_EOS_TEXTS)
    )
    logit = await rm.batcher.submit(text)
    value = 0.5 * (1.0 + math.tanh(logit / 2)) if sigmoid else logit  # overflow-free sigmoid
    return {"reward": scale * value + shift, "rm_logit": logit}
