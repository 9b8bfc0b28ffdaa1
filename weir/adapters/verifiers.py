"""verifiers (``pip install 'weir[verifiers]'``): a verifiers environment as weir's rollout and
reward. Its dataset is the prompts, its turns are played by weir's engine, its rubric is the reward.

```yaml
rollout: {function: weir.adapters.verifiers:rollout, n: 8}
verifiers:
  env: my_pkg.envs:load_environment     # a function returning a vf.Environment, or an installed env id
  env_args: {num_train_examples: 2000}
agent: {tool_format: hermes, max_tokens: 512}
```

The environment is loaded once per process (``verifiers.env``: a dotted path to a function
returning a ``vf.Environment``, or the id of an environment package, ``vf.load_environment``)
and checked when the run starts. Its rows: ``env.get_dataset()`` for training and
``env.get_eval_dataset()`` held out (without an eval dataset, the last ``data.eval_size`` rows
of its dataset are held out and left out of training); each row keeps the dataset's whole entry
(prompt messages with the environment's system prompt and few-shot, answer, info) under
``"vf_input"``.

An episode is weir's multi-turn episode (`weir.rollout.multi_turn.run_episode`) over
`VerifiersEpisode`, which drives the environment the way ``MultiTurnEnv.rollout`` does, with
weir's engine in place of verifiers' client: ``init_state`` and ``setup_state``, then the
prompt messages (``get_prompt_messages``) rendered by the chat template with the
environment's tools; after each model turn, ``add_model_response`` (its text as an assistant
message, tool calls parsed in ``agent.tool_format``), the stop conditions (``is_completed``),
and ``env_response``'s messages (tool results, a user reply), appended as context ids
(``loss_mask`` 0) laid out as the template lays out those messages. The model's tokens are the
engine's own ids, never re-encoded. After the episodes of a row, ``cleanup`` renders each
completion and ``rubric.score_group`` scores them together (group reward functions included):
its reward is the sample's reward, its metrics land in ``reward_info``.

An environment that raises, hangs past ``agent.env_timeout_s`` or returns what weir cannot
show fails that episode (``EnvError``, counted in ``agent/env_errors``); a rubric that raises or
hangs past ``reward.timeout_s`` fails the row's samples (``RewardError``); never the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import threading
import time
import uuid
from typing import Any

from weir.data.sample import Group, Sample, Status
from weir.plugins import import_path
from weir.rollout.env import StepResult
from weir.rollout.multi_turn import episode_segments, run_episode, seeded_by_row
from weir.rollout.observation import ChatMessages
from weir.rollout.single_turn import RolloutContext
from weir.rollout.tool_calls import get_tool_format

__all__ = ["load", "rows", "rollout", "check_run", "VerifiersEpisode", "ROLLOUT"]

ROLLOUT = "weir.adapters.verifiers:rollout"

# verifiers environments weir cannot play, by class name (anywhere in the class's MRO), and why
UNSUPPORTED = {
    "EnvGroup": "it routes each row to one of several environments; give one of them",
    "SandboxEnv": "its tools run in remote Prime sandboxes, which weir does not start",
    "CliAgentEnv": "its agent is an outside program that calls the model through verifiers' "
    "interception server, not weir's engine",
    "HarborEnv": "its agent is an outside program that calls the model through verifiers' "
    "interception server, not weir's engine",
    "MCPEnv": "its tools are MCP servers that verifiers starts and connects to itself",
    "BrowserEnv": "its tools drive a remote browser service",
}

_LOADED: dict[str, Any] = {}


def _vf() -> Any:
    try:
        import verifiers as vf

        vf.MultiTurnEnv  # noqa: B018  (loads verifiers' environment stack)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"verifiers.env needs the verifiers package (0.3): pip install 'weir[verifiers]' "
            f"({type(e).__name__}: {e})"
        ) from e
    return vf


def load(section: Any) -> Any:
    """The environment `section` names, built and checked once per process."""
    key = json.dumps([section.env, section.env_args], sort_keys=True, default=str)
    if key not in _LOADED:
        _LOADED[key] = _check(_build(section), section)
    return _LOADED[key]


@contextlib.contextmanager
def _own_signals() -> Any:
    """verifiers' Environment installs its own SIGINT / SIGTERM handlers when it is built; keep
    the process's."""
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _build(section: Any) -> Any:
    vf = _vf()
    where = f"verifiers.env={section.env!r}"
    with _own_signals():
        if ":" in section.env:
            fn = import_path(section.env, kind="verifiers.env")
            try:
                return fn(**section.env_args)
            except Exception as e:
                raise ValueError(f"{where} raised {type(e).__name__}: {e}") from None
        try:
            return vf.load_environment(section.env, **section.env_args)
        except Exception as e:
            raise ValueError(
                f"{where}: {e} (an installed verifiers environment's id, or a dotted path "
                "pkg.mod:fn to a function returning a vf.Environment)"
            ) from None


def _rubrics(rubric: Any) -> list[Any]:
    """`rubric` and, for a RubricGroup, every rubric inside it."""
    return [rubric, *(r for inner in getattr(rubric, "rubrics", []) for r in _rubrics(inner))]


def _check(env: Any, section: Any) -> Any:
    """Refuse, in one line, an environment weir cannot play exactly."""
    vf = _vf()
    where = f"verifiers.env={section.env!r}"
    if not isinstance(env, vf.Environment):
        raise ValueError(f"{where} gave a {type(env).__name__}, not a vf.Environment")
    for cls in type(env).__mro__:
        if cls.__name__ in UNSUPPORTED:
            raise ValueError(
                f"{where}: a {cls.__name__}, which weir cannot play: {UNSUPPORTED[cls.__name__]}"
            )
    if not isinstance(env, vf.MultiTurnEnv):
        raise ValueError(
            f"{where}: a {type(env).__name__} with a rollout of its own; weir plays "
            "MultiTurnEnv environments (SingleTurnEnv, MultiTurnEnv, ToolEnv, StatefulToolEnv)"
        )
    for name in ("rollout", "get_model_response"):
        if getattr(type(env), name) is not getattr(vf.MultiTurnEnv, name):
            raise ValueError(
                f"{where}: {type(env).__name__} overrides {name}, which calls the model through "
                "verifiers' client; weir's engine plays the model's turns"
            )
    if getattr(env, "message_type", "chat") != "chat":
        raise ValueError(f"{where}: message_type={env.message_type!r}; weir plays chat")
    if not env.score_rollouts:
        raise ValueError(f"{where} does not score its rollouts (score_rollouts=False)")
    for r in _rubrics(env.rubric):
        if isinstance(r, vf.JudgeRubric):
            raise ValueError(
                f"{where}: its {type(r).__name__} asks an outside LLM (judge_client) for the "
                "reward; use a rubric of functions, or weir's reward.function: judge"
            )
    if env.rubric.has_advantages:
        raise ValueError(
            f"{where}: its rubric computes advantages (@vf.advantage); weir computes them "
            "(algo.advantage)"
        )
    return env


def check_run(cfg: Any) -> Any:
    """The verifiers section, once the run's other settings agree with it; loads the
    environment now, so a bad one stops the run at its start."""
    if cfg.rollout.function != ROLLOUT:
        raise ValueError(
            f"verifiers.env is set: set rollout.function={ROLLOUT} (it is {cfg.rollout.function})"
        )
    if cfg.reward.function is not None or cfg.reward.components:
        raise ValueError(
            "verifiers.env: the environment's rubric is the reward; unset reward.function / "
            "reward.components (add reward functions to the rubric instead)"
        )
    if cfg.data.system_prompt is not None:
        raise ValueError(
            "verifiers.env: the environment defines its system prompt (its dataset's prompts); "
            "unset data.system_prompt"
        )
    load(cfg.verifiers)
    return cfg.verifiers


# --------------------------------------------------------------------------------------- rows


def rows(section: Any, split: str, n: int, eval_size: int) -> list[dict[str, Any]]:
    """`n` rows of `split` ("train" or "test") from the environment's datasets."""
    env = load(section)
    has_eval = env.eval_dataset is not None or env.eval_dataset_source is not None
    has_train = env.dataset is not None or env.dataset_source is not None
    if split == "test" and has_eval:
        data = env.get_eval_dataset(n=n)
    elif not has_train:
        raise ValueError(
            f"verifiers.env={section.env!r} has only an eval dataset; weir trains on its dataset"
        )
    else:
        data = env.get_dataset()
        cut = 0 if has_eval else eval_size
        if len(data) <= cut:
            raise ValueError(
                f"verifiers.env={section.env!r}: its dataset has {len(data)} rows and no eval "
                f"dataset to hold out data.eval_size={eval_size} of them; lower data.eval_size"
            )
        keep = range(len(data) - cut, len(data)) if split == "test" else range(len(data) - cut)
        data = data.select(list(keep)[:n])
    return [_row(dict(r)) for r in data]


def _row(entry: dict[str, Any]) -> dict[str, Any]:
    entry = json.loads(json.dumps(entry, default=str))
    entry["prompt"] = [_drop_none(m) for m in entry.get("prompt") or []]
    users = [m.get("content") for m in entry["prompt"] if m.get("role") == "user"]
    text = users[-1] if users and isinstance(users[-1], str) else json.dumps(entry["prompt"])
    return {"prompt": text, "answer": str(entry.get("answer", "")), "vf_input": entry}


def _drop_none(m: Any) -> Any:
    return {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m


# ------------------------------------------------------------------------------------ episode


class _EngineOnly:
    """Stands in for verifiers' client in an episode's state: weir's engine generates, so
    nothing may call it."""

    def __new__(cls) -> Any:
        vf = _vf()

        def refuse(*_: Any, **__: Any) -> Any:
            raise RuntimeError(
                "weir's engine plays the model's turns; this environment called verifiers' client"
            )

        methods = (
            "setup_client",
            "to_native_tool",
            "to_native_prompt",
            "get_native_response",
            "raise_from_native_response",
            "from_native_response",
            "close",
        )
        client_cls = type("WeirEngineOnly", (vf.Client,), dict.fromkeys(methods, refuse))
        return client_cls(None)


def _text(content: Any, text_only: bool = True) -> Any:
    """A message's content as text (its text parts joined). Other parts (images, audio) are
    refused with `text_only`, else the parts are kept (and refused as an observation)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else getattr(p, "type", None)
        if kind != "text":
            if text_only:
                raise TypeError(f"a {kind!r} content part: weir plays text verifiers environments")
            return [p if isinstance(p, dict) else p.model_dump() for p in content]
        parts.append(p["text"] if isinstance(p, dict) else p.text)
    return "".join(parts)


def _plain(message: Any, text_only: bool = True) -> dict[str, Any]:
    """A verifiers message (pydantic or dict) as a chat-template message."""
    m = message.model_dump() if hasattr(message, "model_dump") else dict(message)
    out: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"), text_only)}
    if m.get("tool_calls"):
        out["tool_calls"] = [_openai_call(c) for c in m["tool_calls"]]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _openai_call(call: Any) -> dict[str, Any]:
    c = call if isinstance(call, dict) else call.model_dump()
    args = c.get("arguments", "{}")
    with contextlib.suppress(TypeError, ValueError):
        args = json.loads(args) if isinstance(args, str) else args
    return {
        "id": c.get("id"),
        "type": "function",
        "function": {"name": c["name"], "arguments": args},
    }


def _schema(tool: Any) -> dict[str, Any]:
    t = tool.model_dump() if hasattr(tool, "model_dump") else dict(tool)
    fn = {"name": t["name"], "description": t.get("description", ""), "parameters": t["parameters"]}
    return {"type": "function", "function": fn}


class VerifiersEpisode:
    """One episode of a verifiers ``MultiTurnEnv`` as weir's env (async ``reset`` / ``step``),
    following ``MultiTurnEnv.rollout`` turn by turn with weir's engine in place of its client.

    `reset` returns the prompt messages; `step` records the model's turn in the environment's
    state and returns its next messages (`ChatMessages`), or ends the episode when a stop
    condition holds (or ``env_response`` set ``final_env_response``). `finish` adds a last turn
    the episode was cut at and runs the environment's cleanup, which renders the completion the
    rubric scores.
    """

    def __init__(self, env: Any, tool_format: str) -> None:
        self.env = env
        self.format = get_tool_format(tool_format)
        self.state: Any = None
        self.shown: list[Any] = []  # the messages of the model's last turn's prompt
        self.tool_schemas: list[dict[str, Any]] | None = None
        self.raw_action = False
        self.turns = 0  # model turns recorded in the state

    async def reset(self, row: dict) -> list[dict[str, Any]]:
        if "vf_input" not in row:
            raise ValueError(
                "this row has no verifiers entry ('vf_input'); rows come from verifiers.env"
            )
        state = await self.env.init_state(row["vf_input"], _EngineOnly(), "weir")
        state = await self.env.setup_state(state) or state
        self.state = state
        self.tool_schemas = [_schema(t) for t in state.get("tool_defs") or []] or None
        self.raw_action = bool(self.tool_schemas) and bool(
            getattr(self.format, "special_tokens", False)
        )
        if await self.env.is_completed(state):
            raise RuntimeError(f"the episode stopped before the model's first turn ({_why(state)})")
        self.shown = list(await self.env.get_prompt_messages(state))
        return [_plain(m) for m in self.shown]

    async def step(self, text: str) -> StepResult:
        info = await self._record(text, truncated=False)
        state = self.state
        if await self.env.is_completed(state):
            if state.get("error") is not None:
                raise RuntimeError(_why(state))
            return StepResult(None, 0.0, True, info)
        before = len(self.shown) + len(state["trajectory"][-1]["completion"])
        prompt = list(await self.env.get_prompt_messages(state))
        if state.get("final_env_response") is not None:  # shown to the rubric, not the model
            await self.env.is_completed(state)
            return StepResult(None, 0.0, True, info)
        history = [*self.shown, *state["trajectory"][-1]["completion"]]
        if [_plain(m, False) for m in prompt[:before]] != [_plain(m, False) for m in history]:
            raise ValueError(
                "get_prompt_messages rewrote the conversation so far; weir continues each turn "
                "from the ids of the last one and plays linear conversations only"
            )
        self.shown = prompt
        new = [_plain(m, text_only=False) for m in prompt[before:]]  # malformed: a bad result
        return StepResult(ChatMessages(new), 0.0, False, info)

    async def _record(self, text: str, truncated: bool) -> dict[str, int]:
        """`text` as the assistant message of the state's next trajectory step."""
        from verifiers.types import Response, ResponseMessage, ToolCall

        calls: list[Any] = []
        content, info = text, {}
        if self.tool_schemas:
            parsed = self.format.parse(text, self.tool_schemas)
            calls = [
                ToolCall(id=c.id, name=c.name, arguments=json.dumps(c.arguments))
                for c in parsed.calls
            ]
            content = parsed.content if calls else text
            info = {"tool_calls": len(calls), "malformed_calls": len(parsed.errors)}
        message = ResponseMessage(
            content=content,
            tool_calls=calls or None,
            finish_reason="length" if truncated else ("tool_calls" if calls else "stop"),
            is_truncated=truncated,
        )
        response = Response(
            id=f"weir-{uuid.uuid4().hex[:12]}",
            created=int(time.time()),
            model="weir",
            message=message,
        )
        await self.env.add_model_response(self.state, self.shown, response)
        self.turns += 1
        return info

    async def finish(self, sample: Sample, timeout: float | None) -> None:
        """After the episode: record a last model turn the environment did not get (cut at
        ``max_new_tokens`` or ``agent.max_tokens``), then the environment's cleanup (which
        renders ``state["completion"]``). A failure fails the sample as an environment error."""
        if self.state is None:
            return
        try:
            if sample.status != Status.FAILED:
                turns = sum(t["role"] == "assistant" for t in sample.metadata.get("turns", []))
                if turns > self.turns:
                    await asyncio.wait_for(self._record(sample.response_text, True), timeout)
                    self.state["is_truncated"] = True
            await asyncio.wait_for(self.env.cleanup(self.state), timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if sample.status != Status.FAILED:
                _fail_env(sample, e, timeout)


def _why(state: Any) -> str:
    err = state.get("error")
    if err is not None:
        return f"{type(err).__name__}: {err}"
    return f"stop condition {state.get('stop_condition')}"


def _fail_env(sample: Sample, e: BaseException, timeout: float | None) -> None:
    if isinstance(e, asyncio.TimeoutError):
        e = TimeoutError(
            f"the environment's cleanup took longer than agent.env_timeout_s={timeout} s"
        )
    sample.status, sample.reward = Status.FAILED, None
    sample.error = f"EnvError: {type(e).__name__}: {e}"
    metrics = sample.metadata.setdefault("metrics", {})
    metrics["agent/env_errors"] = 1.0
    if isinstance(e, TimeoutError):
        metrics["agent/env_timeouts"] = 1.0


# ------------------------------------------------------------------------------------ rollout


async def rollout(ctx: RolloutContext, row: dict) -> Group:
    """`ctx.sampling.n` episodes of the verifiers environment on `row`, scored together by its
    rubric (the verifiers section is ``ctx.extras["verifiers"]``, the agent section
    ``ctx.extras["agent"]``)."""
    section = ctx.extras.get("verifiers")
    if section is None:
        raise ValueError(f"rollout.function={ROLLOUT} needs the verifiers section (verifiers.env)")
    env = load(section)
    agent = _episode_agent(ctx.extras.get("agent"), env)
    ctx = seeded_by_row(ctx, row)
    episodes = [VerifiersEpisode(env, agent.tool_format) for _ in range(ctx.sampling.n)]
    samples = await asyncio.gather(
        *(run_episode(ctx, row, ep, agent, index=i) for i, ep in enumerate(episodes))
    )
    await asyncio.gather(
        *(ep.finish(s, agent.env_timeout_s) for ep, s in zip(episodes, samples, strict=True))
    )
    await _score(env, episodes, samples, ctx.reward_timeout_s)
    return Group(samples=episode_segments(samples), row=row)


def _episode_agent(agent: Any, env: Any) -> Any:
    """The agent settings of a verifiers episode: the environment's own max_turns (when it has
    one), and no reward from weir's side (the rubric gives it)."""
    if agent is None:
        from weir.config.schema import AgentConfig

        agent = AgentConfig()
    max_turns = env.max_turns if getattr(env, "max_turns", -1) > 0 else agent.max_turns
    return agent.model_copy(update={"reward": "env", "max_turns": max_turns})


async def _score(
    env: Any, episodes: list[VerifiersEpisode], samples: list[Sample], timeout: float | None
) -> None:
    """``rubric.score_group`` over the row's finished episodes; its reward and metrics into each
    sample. A rubric that raises, hangs or gives a non-finite reward fails those samples."""
    live = [
        (ep.state, s) for ep, s in zip(episodes, samples, strict=True) if s.status != Status.FAILED
    ]
    if not live:
        return
    states = [st for st, _ in live]
    error = None
    try:
        await asyncio.wait_for(env.rubric.score_group(states), timeout)
    except asyncio.TimeoutError:
        error = f"RewardError: timeout: the verifiers rubric took longer than {timeout} s"
    except asyncio.CancelledError:
        raise
    except Exception as e:
        error = f"RewardError: {type(e).__name__}: {e} (in the verifiers rubric)"
    for state, sample in live:
        for k in ("task_reward", "env_return"):
            sample.reward_info.pop(k, None)
        reward = None if error else _number(state.get("reward"))
        if reward is None:
            sample.status, sample.reward = Status.FAILED, None
            sample.error = (
                error or f"RewardError: the verifiers rubric gave {state.get('reward')!r}"
            )
            continue
        sample.reward = reward
        metrics = {k: v for k, v in (state.get("metrics") or {}).items() if _number(v) is not None}
        sample.reward_info.update({**{k: float(v) for k, v in metrics.items()}, "reward": reward})
    for state in states:  # the rubric's own cleanup, as verifiers runs it after scoring
        with contextlib.suppress(Exception):
            await asyncio.wait_for(env.rubric.cleanup(state), timeout)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
