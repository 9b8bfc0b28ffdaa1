"""The multi-turn rollout function: model turns interleaved with environment observations.

One episode (one `Sample`)::

    prompt_ids = template(env.reset(row) or the row's prompt, tools=...)
    repeat until done, agent.max_turns model turns, or agent.max_tokens response tokens:
        model turn   = engine.generate(prompt_ids + response_ids)    -> loss_mask 1, engine logprobs/versions
        obs, r, done = env.step(decoded model turn)
        observation  = encode(tool-turn prefix + obs + suffix)       -> loss_mask 0, logprob 0, version -1

The trajectory is token-exact: `response_ids` is the concatenation of the ids the engine returned
and the observation ids appended, in order; nothing trained on is decoded and re-encoded.
The prefix and suffix around an observation come from the tokenizer's chat template (the text
between the assistant's end-of-turn token and a tool message's content, and from its end up to the
next assistant header), so the model sees the same layout it saw in SFT.

Reward: ``task`` = the reward function on the sample (``sample.response_text`` is the final
model turn; the whole decoded transcript is in ``metadata["transcript"]``); ``env_return`` =
``sum_t gamma^t r_t`` over the environment's step rewards; the sample's reward is `task`,
`env_return` or their sum per ``agent.reward``. Both parts and the per-step rewards are in
``reward_info``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import queue
import threading
from dataclasses import dataclass, replace
from typing import Any

from weir.data.prompts import PromptTooLong, prompt_messages
from weir.data.sample import Group, Sample, Status
from weir.engine.base import Completion
from weir.plugins import resolve
from weir.rollout.env import StepResult, ToolEnv, as_step_result
from weir.rollout.observation import ChatMessages, Observation, as_observation
from weir.rollout.rewards import score
from weir.rollout.single_turn import RolloutContext
from weir.rollout.tool_calls import get_tool_format, raw_turn_text
from weir.rollout.vision_episode import (
    PLACEHOLDER_ERROR,
    EpisodeImages,
    episode_images,
    split_segments,
)

__all__ = [
    "rollout",
    "run_episode",
    "ObservationCodec",
    "observation_codec",
    "encode_messages",
    "make_env",
]

COUNTERS = ("tool_calls", "tool_errors", "malformed_calls", "invalid_actions")
ENV_ERRORS = ("env_errors", "env_timeouts", "env_bad_results")
"""Per-episode counters of environment failures, each of which also fails its sample:
`env_errors` counts them all, `env_timeouts` a reset or step past ``agent.env_timeout_s``,
`env_bad_results` a result of the wrong shape (a malformed observation)."""
_MARK_A, _MARK_T = "\x00weir-assistant\x00", "\x00weir-tool\x00"


@dataclass(frozen=True)
class ObservationCodec:
    """Encodes an observation as the ids of a tool turn: ``prefix + text + suffix``, encoded once."""

    tokenizer: Any
    prefix: str
    suffix: str

    def encode(self, text: str | ChatMessages) -> list[int]:
        if isinstance(text, ChatMessages):
            return encode_messages(self.tokenizer, text.messages, self)
        ids = self.tokenizer(self.prefix + text + self.suffix, add_special_tokens=False)
        return [int(i) for i in ids["input_ids"]]


def encode_messages(
    tokenizer: Any, messages: list[dict[str, Any]], plain: ObservationCodec | None = None
) -> list[int]:
    """The ids that follow a finished assistant turn when `messages` come next and the model
    answers them: the chat template over ``[user, assistant, *messages]`` with the generation
    prompt, from the assistant's end-of-turn token on (as `observation_codec` takes one tool
    turn's wrapper), so consecutive messages are laid out as the template groups them. Without
    a template, each message's content between newlines (`plain`'s wrapper)."""
    if not getattr(tokenizer, "chat_template", None):
        codec = plain or ObservationCodec(tokenizer, "\n", "\n")
        text = "".join(codec.prefix + m["content"] + codec.suffix for m in messages)
    else:
        chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK_A}]
        full = tokenizer.apply_chat_template(
            chat + [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
        text = full[_after_assistant(tokenizer, full) :]
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def observation_codec(tokenizer: Any, role: str = "tool") -> ObservationCodec:
    """The tool-turn wrapper of `tokenizer`'s chat template (a plain newline without a template).

    Rendered as ``[user, assistant, tool]`` with the generation prompt: the prefix is the text
    between the assistant's end-of-turn token and the tool content, the suffix what follows it.
    """
    if not getattr(tokenizer, "chat_template", None):
        return ObservationCodec(tokenizer, "\n", "\n")
    chat = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _MARK_A},
        {"role": role, "content": _MARK_T},
    ]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    start = _after_assistant(tokenizer, text)
    mid = text.index(_MARK_T)
    return ObservationCodec(tokenizer, text[start:mid], text[mid + len(_MARK_T) :])


def _after_assistant(tokenizer: Any, text: str) -> int:
    """Where `text` (a rendered chat) goes on after the marker assistant turn and its EOS."""
    start = text.index(_MARK_A) + len(_MARK_A)
    eos = tokenizer.eos_token or ""
    return start + len(eos) if eos and text.startswith(eos, start) else start


def make_env(agent: Any) -> Any:
    """A fresh environment for one episode from the `agent` config section."""
    if agent.env is None:
        return ToolEnv(list(agent.tools), agent.tool_format, timeout_s=agent.tool_timeout_s)
    factory = resolve(agent.env, {}, "agent.env")
    return factory(**agent.env_kwargs)


async def rollout(ctx: RolloutContext, row: dict) -> Group:
    """`ctx.sampling.n` independent episodes on `row` (the `agent` config is ``ctx.extras["agent"]``)."""
    agent = ctx.extras.get("agent")
    if agent is None:
        from weir.config.schema import AgentConfig

        agent = AgentConfig()
    ctx = seeded_by_row(ctx, row)
    factory = ctx.extras.get("env_factory")  # an adapter's environment (weir.adapters)
    samples = await asyncio.gather(
        *(
            run_episode(ctx, row, factory() if factory else make_env(agent), agent, index=i)
            for i in range(ctx.sampling.n)
        )
    )
    return Group(samples=episode_segments(samples), row=row)


def episode_segments(episodes: list[Sample]) -> list[Sample]:
    """The training samples of `episodes`: each episode's sample, or its segments where image
    memory rewrote its context (`weir.rollout.vision_episode`), tagged ``metadata["episode"]``."""
    out = []
    for i, s in enumerate(episodes):
        for seg in split_segments(s) if s.metadata.get("segments") else [s]:
            seg.metadata["episode"] = i
            out.append(seg)
    return out


def seeded_by_row(ctx: RolloutContext, row: dict) -> RolloutContext:
    """`ctx` with a sampling seed from (run seed, weight version, row), unless it has one.

    A later turn reaches the engine when an earlier one ends (and a tool returns), in an order that
    varies with batching and thread timing; seeds drawn from the engine's stream in that order
    made two runs of one config sample differently. Every turn's seed derives from this one
    (`_turn_seed` adds the prompt, episode and turn), so a run repeats, and resumes, exactly."""
    if ctx.sampling.seed is not None:  # evaluation: one seed for every row
        return ctx
    version = getattr(ctx.engine, "version", 0)
    seed = _turn_seed(ctx.extras.get("run_seed", 0), [row.get("_index", -1)], version, 0)
    return ctx.with_sampling(seed=seed)


async def run_episode(
    ctx: RolloutContext, row: dict, env: Any, agent: Any, index: int = 0
) -> Sample:
    """Play one episode of `env` with the engine; returns the scored sample (never raises for
    environment errors: those fail the sample with ``error = "EnvError: ..."``)."""
    codec = ctx.extras.get("observation_codec") or observation_codec(ctx.tokenizer)
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    behavior: list[float] = []  # under the truncated distribution sampled from (top-k/top-p)
    truncated_sampling = False
    versions: list[int] = []
    turns: list[dict[str, Any]] = []
    env_rewards: list[float] = []
    counts = dict.fromkeys(COUNTERS, 0)
    env_errors = dict.fromkeys(ENV_ERRORS, 0)
    status, stop, error, final_text = Status.COMPLETED, "max_turns", None, ""
    env_info: dict[str, Any] = {}  # the environment's last info, for the reward function
    prompt_ids: list[int] = []
    timeout = getattr(agent, "env_timeout_s", None)
    worker = _EnvThread()  # the episode's sync env calls, in order, on one thread of their own
    routed = None  # the last turn's recorded routing: the conversation it ran (algo.routing_replay)
    media = episode_images(ctx)  # a vision-language model: images in the prompt and observations
    try:
        first = await _env_reset(env, row, timeout, worker)
        tools = getattr(env, "tool_schemas", None)
        if media is None:
            prompt_ids = _encode_prompt(ctx, row, first, tools, agent)
        else:
            show = tools if tools and agent.show_tools else None
            p = ctx.extras.get("prompt", {})
            prompt_ids = media.encode_prompt(row, first, show, p, ctx.encode_prompt)
        for turn in range(agent.max_turns):
            budget = agent.max_tokens - len(ids)
            if budget <= 0:
                status, stop = Status.TRUNCATED, "max_tokens"
                break
            params = replace(
                ctx.sampling,
                n=1,
                max_new_tokens=min(ctx.sampling.max_new_tokens, budget),
                seed=_turn_seed(ctx.sampling.seed, prompt_ids, index, turn),
                keep_kv=turn < agent.max_turns - 1,  # the next turn may reuse this one's KV
            )
            context, vision = (
                (prompt_ids + ids, None) if media is None else media.context(prompt_ids + ids)
            )
            (c,) = await ctx.engine.generate(
                context, params, **({"vision": vision} if vision is not None else {})
            )
            _append(ids, mask, logprobs, versions, c)
            routed = c.routed_experts
            behavior += c.logprobs if c.sampled_logprobs is None else c.sampled_logprobs
            truncated_sampling |= c.sampled_logprobs is not None
            final_text = ctx.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            turns.append({"role": "assistant", "tokens": len(c.token_ids)})
            if media is not None and media.emitted_placeholder(c.token_ids):
                status, error, stop = Status.FAILED, PLACEHOLDER_ERROR, "error"
                break
            cut = c.finish_reason != "stop"
            if c.finish_reason == "abort" or (cut and not agent.play_cut_turns):
                status = Status.ABORTED if c.finish_reason == "abort" else Status.TRUNCATED
                stop = "abort" if c.finish_reason == "abort" else "length"
                break
            action = (
                raw_turn_text(ctx.tokenizer, c.token_ids, c.finish_reason)
                if getattr(env, "raw_action", False)
                else final_text
            )
            step = await _env_step(env, action, timeout, worker)
            env_rewards.append(step.reward)
            env_info = step.info
            for k in COUNTERS:
                counts[k] += step.info[k]
            if step.done or step.observation is None:
                stop = "done"
                break
            if turn == agent.max_turns - 1:
                status = Status.TRUNCATED
                break
            obs_ids = _observation_ids(media, codec, step.observation, prompt_ids + ids, agent)
            if obs_ids is None:  # over the image-token bound (vision.max_image_tokens)
                status, stop = Status.TRUNCATED, media.stop if media else "max_tokens"
                break
            if len(ids) + len(obs_ids) >= agent.max_tokens:
                status, stop = Status.TRUNCATED, "max_tokens"
                break
            ids += obs_ids
            mask += [0] * len(obs_ids)
            logprobs += [0.0] * len(obs_ids)
            behavior += [0.0] * len(obs_ids)
            versions += [-1] * len(obs_ids)
            turns.append({"role": "observation", "tokens": len(obs_ids)})
    except _EnvFailure as e:  # the environment must not end the run; engine errors propagate
        cause = e.__cause__
        status, error, stop = Status.FAILED, f"EnvError: {type(cause).__name__}: {cause}", "error"
        env_errors["env_errors"] = 1
        if isinstance(cause, TimeoutError):
            env_errors["env_timeouts"] = 1
        elif isinstance(cause, (TypeError, ValueError)) and e.bad_result:
            env_errors["env_bad_results"] = 1
    finally:
        close = getattr(env, "close", None)
        if callable(close) and not env_errors["env_timeouts"]:  # a hung env's thread is busy
            with contextlib.suppress(
                Exception
            ):  # a failing or hung close() must not hide the episode
                await _call_env(lambda _: close(), None, timeout, worker)
        worker.stop()
    sample = Sample(
        prompt_ids=prompt_ids,
        response_ids=ids,
        loss_mask=mask,
        rollout_logprobs=logprobs,
        behavior_logprobs=behavior if truncated_sampling else None,
        versions=versions,
        status=status,
        error=error,
        index=index,
        row=row,
        response_text=final_text,
        routed_experts=routed,
    )
    model_turns = sum(t["role"] == "assistant" for t in turns)
    if media is not None:  # its pixels, and the segments its image memory made
        media.finish(sample)
    sample.metadata["transcript"] = ctx.tokenizer.decode(ids, skip_special_tokens=False)
    sample.metadata["turns"] = turns
    sample.metadata["env_info"] = env_info
    sample.metadata["metrics"] = {
        "agent/turns": float(model_turns),
        **{f"agent/{k}": float(v) for k, v in counts.items()},
        **{f"agent/{k}": float(v) for k, v in env_errors.items()},
    }
    if status != Status.FAILED:
        await _score(ctx, sample, row, agent, env_rewards)
    sample.reward_info.update(
        {"env_rewards": env_rewards, "turns": model_turns, "stop": stop, **counts}
    )
    return sample


def _observation_ids(
    media: EpisodeImages | None, codec: ObservationCodec, value: Any, raw: list[int], agent: Any
) -> list[int] | None:
    """The ids of the observation `value` (a string; with a vision-language model also an
    `Observation` or content parts, through `media`); None when it does not fit. A malformed
    observation, or images for a text-only model, fails the episode as an environment error."""
    try:
        if media is not None:
            room = agent.max_tokens - (len(raw) - media.prompt_length)
            return media.observation(value, len(raw), room, codec)
        obs = as_observation(value)
        if not isinstance(obs, (str, ChatMessages)):
            raise TypeError("the observation has images, but the model takes none")
        return codec.encode(obs)
    except (TypeError, ValueError) as e:
        raise _EnvFailure(str(e), bad_result=True) from e


class _EnvFailure(Exception):
    """An exception raised by the environment's reset or step (its __cause__); `bad_result` when
    the call returned but its result had the wrong shape."""

    def __init__(self, message: str, bad_result: bool = False) -> None:
        super().__init__(message)
        self.bad_result = bad_result


async def _call_env(fn: Any, arg: Any, timeout: float | None, worker: _EnvThread) -> Any:
    """``fn(arg)`` under `timeout`: a sync method runs on the episode's own thread (`worker`), so
    an environment that blocks stalls no other episode, and every call of one environment runs on
    the same thread (thread-bound resources such as sqlite connections keep working); an async
    method is awaited."""
    call = fn(arg) if inspect.iscoroutinefunction(fn) else worker.submit(fn, arg)
    try:
        result = await asyncio.wait_for(call, timeout)
        if inspect.isawaitable(result):
            result = await asyncio.wait_for(result, timeout)
    except asyncio.TimeoutError:
        name = getattr(fn, "__qualname__", "env call")
        raise TimeoutError(f"{name} took longer than agent.env_timeout_s={timeout} s") from None
    return result


class _EnvThread:
    """One daemon thread running an episode's sync environment calls in order. A call that hangs
    keeps the thread (it cannot be killed; being a daemon it never holds up the process's exit);
    the episode has already failed by then and submits nothing more."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Any, arg: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="weir-env")
            self._thread.start()
        self._jobs.put((loop, future, fn, arg))
        return future

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, arg = job
            try:
                value, ok = fn(arg), True
            except BaseException as e:  # handed to the awaiting episode
                value, ok = e, False
            with contextlib.suppress(RuntimeError):  # the loop may be gone after a timeout
                loop.call_soon_threadsafe(_settle, future, ok, value)


def _settle(future: asyncio.Future, ok: bool, value: Any) -> None:
    if not future.done():
        future.set_result(value) if ok else future.set_exception(value)


async def _env_reset(env: Any, row: dict, timeout: float | None, worker: _EnvThread) -> Any:
    """``env.reset(row)`` (sync or async), checked; failures become `_EnvFailure`."""
    try:
        first = await _call_env(env.reset, row, timeout, worker)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise _EnvFailure(str(e)) from e
    if first is not None and not isinstance(first, (str, list, Observation)):
        err = TypeError(
            "env.reset must return None, a str, an Observation or a list of messages, got "
            f"{type(first).__name__}"
        )
        raise _EnvFailure(str(err), bad_result=True) from err
    return first


async def _env_step(env: Any, action: str, timeout: float | None, worker: _EnvThread) -> StepResult:
    """``env.step(action)`` (sync or async), checked, with its counters read as ints. Any
    exception, a timeout or a wrong result becomes `_EnvFailure`, which fails the sample (engine
    errors, in contrast, propagate to the collector as rollout errors)."""
    try:
        value = await _call_env(env.step, action, timeout, worker)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise _EnvFailure(str(e)) from e
    try:
        step = as_step_result(value)
        for k in COUNTERS:
            v = step.info.get(k) or 0
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"env.step info[{k!r}] must be a number, got {v!r}")
            step.info[k] = int(v)
        return step
    except Exception as e:
        raise _EnvFailure(str(e), bad_result=True) from e


async def _score(
    ctx: RolloutContext, sample: Sample, row: dict, agent: Any, env_rewards: list[float]
) -> None:
    """reward = task (reward function), env_return = sum_t gamma^t r_t, or their sum."""
    env_return = sum((r * agent.turn_discount**t for t, r in enumerate(env_rewards)), 0.0)
    task = 0.0
    if agent.reward != "env":
        await score(ctx.reward_fn, sample, row, timeout_s=ctx.reward_timeout_s)
        if sample.reward is None:  # the reward function failed; score() recorded why
            return
        task = sample.reward
    total = {"task": task, "env": env_return, "sum": task + env_return}[agent.reward]
    sample.reward = total
    sample.reward_info.update({"reward": total, "task_reward": task, "env_return": env_return})


def _append(ids: list, mask: list, logprobs: list, versions: list, c: Completion) -> None:
    ids += c.token_ids
    mask += [1] * len(c.token_ids)
    logprobs += c.logprobs
    versions += c.versions


def _turn_seed(seed: int | None, prompt_ids: list[int], index: int, turn: int) -> int | None:
    """A per-(prompt, episode, turn) seed, so that seeded episodes of different prompts (e.g. in
    evaluation, where every row shares one seed) draw independent random numbers."""
    if seed is None:
        return None
    key = json.dumps([seed, index, turn, prompt_ids]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big") % (2**31 - 1)


def _encode_prompt(
    ctx: RolloutContext, row: dict, first: Any, tools: list[dict] | None, agent: Any
) -> list[int]:
    """Prompt ids for the episode: the configured encoder when there is nothing to add, else the
    chat template over the reset observation (or the row's prompt) with the tools' schemas."""
    show = bool(tools) and agent.show_tools
    if first is None and not show:
        return ctx.encode(row)
    p: dict[str, Any] = ctx.extras.get("prompt", {})
    key = p.get("prompt_key", "prompt")
    if first is not None:
        source = {"messages": first} if isinstance(first, list) else {key: first}
    else:
        source = row
    messages = prompt_messages(source, prompt_key=key, system_prompt=p.get("system_prompt"))
    tok = ctx.tokenizer
    if p.get("use_chat_template", True) and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            messages, tools=tools if show else None, tokenize=False, add_generation_prompt=True
        )
        prompt_ids = [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]
    else:
        text = "\n\n".join(str(m["content"]) for m in messages)
        prompt_ids = [int(i) for i in tok(text)["input_ids"]]
    limit = p.get("max_prompt_tokens")
    if limit is not None and len(prompt_ids) > limit:
        raise PromptTooLong(len(prompt_ids), limit, row.get("_index"))
    return prompt_ids


def agent_extras(cfg: Any) -> dict[str, Any]:
    """What `rollout` reads from ``ctx.extras``: the agent section and the prompt settings. An
    unknown `agent.tool_format` is refused here, when the run starts."""
    try:
        get_tool_format(cfg.agent.tool_format)
    except ValueError as e:
        raise ValueError(f"agent.tool_format: {e}") from None
    d = cfg.data
    return {
        "agent": cfg.agent,
        "run_seed": cfg.run.seed,
        "serve": getattr(
            cfg, "serve", None
        ),  # limits of the OpenAI-compatible server (agent_rollout)
        "prompt": {
            "prompt_key": d.prompt_key,
            "system_prompt": d.system_prompt,
            "use_chat_template": d.chat_template,
            "max_prompt_tokens": d.max_prompt_tokens,
        },
    }
