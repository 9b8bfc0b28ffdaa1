"""Environments for multi-turn episodes: the protocol, and the tools environment.

An environment is any object with two methods, each sync or async (gym-like, text in and out):

- ``reset(row) -> observation``: start an episode for a dataset row. The observation is the first
  prompt: ``None`` (use the row's prompt), a string (the first user message) or a list of chat
  messages.
- ``step(action_text) -> (observation, reward, done, info)``: the model's turn as text (special
  tokens removed). `observation` is what the model is shown next (``None`` when done): a string,
  or, for a vision-language model, text and images (`weir.rollout.observation.Observation`, or
  a list of chat content parts), or chat messages (`weir.rollout.observation.ChatMessages`: a
  user reply, several tool results; rendered as the template lays those messages out),
  `reward` a float for this step, `done` ends the episode, `info` a dict of extras; numeric
  `info` entries named like `ToolEnv`'s counters (``tool_calls``, ``tool_errors``,
  ``malformed_calls``) are summed into the episode's metrics.

An optional ``close()`` (sync or async) is called when the episode ends. One environment instance
serves one episode. An environment with ``raw_action = True`` gets each turn decoded with special
tokens kept (less the closing stop token), for tool-call formats whose markers are special tokens.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from weir.rollout.observation import ChatMessages, Observation, as_observation
from weir.rollout.tool_calls import get_tool_format
from weir.rollout.tools import ToolRegistry

__all__ = ["Env", "StepResult", "ToolEnv", "maybe_await", "as_step_result"]


@runtime_checkable
class Env(Protocol):
    def reset(self, row: dict) -> Any: ...

    def step(self, action: str) -> Any: ...


@dataclass
class StepResult:
    observation: str | Observation | ChatMessages | None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


async def maybe_await(value: Any) -> Any:
    """`value`, awaited if it is awaitable (so sync and async environment methods both work)."""
    return await value if inspect.isawaitable(value) else value


def as_step_result(value: Any) -> StepResult:
    """Check and convert what ``env.step`` returned; a wrong shape raises TypeError saying so."""
    if isinstance(value, StepResult):
        return value
    if not isinstance(value, (tuple, list)) or len(value) != 4:
        raise TypeError(
            "env.step must return (observation, reward, done, info); "
            f"got {type(value).__name__} {value!r:.200}"
        )
    obs, reward, done, info = value
    obs = as_observation(obs, "env.step observation")  # text, or text and images
    reward = 0.0 if reward is None else float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"env.step returned a non-finite reward {reward}")
    return StepResult(obs, reward, bool(done), dict(info or {}))


class ToolEnv:
    """Runs the tool calls of each model turn and returns their results as the observation.

    `fmt` is a tool-call format (a name such as ``hermes``, ``qwen3_coder``, ``llama3_json``,
    ``mistral``, ``deepseek_v3``, ``harmony``, ``tag``, or a dotted path; see
    `weir.rollout.tool_calls.get_tool_format`). A turn without calls (and without malformed
    calls) is the final answer: the episode is done.
    Calls run in order; an unknown tool, bad arguments, an exception or a timeout gives the line
    ``error: <message>`` in the observation, as does a malformed call. Rewards are 0: the task's
    reward function judges the final answer.

    info per step: ``tool_calls``, ``tool_errors`` (calls that failed), ``malformed_calls``.
    """

    def __init__(
        self,
        tools: ToolRegistry | Iterable[Callable[..., Any] | str],
        fmt: str = "hermes",
        *,
        timeout_s: float | None = 10.0,
    ) -> None:
        self.tools = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
        self.fmt = fmt
        self.format = get_tool_format(fmt)  # an unknown format fails here
        self.timeout_s = timeout_s
        # formats whose markers are special tokens are parsed from the turn decoded with them
        self.raw_action = bool(getattr(self.format, "special_tokens", False))

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.tools.schemas()

    def reset(self, row: dict) -> None:
        return None

    async def step(self, action: str) -> StepResult:
        parsed = self.format.parse(action, self.tools.schemas())
        if not parsed.calls and not parsed.errors:
            return StepResult(None, 0.0, True, {"tool_calls": 0, "tool_errors": 0})
        lines, failed = [], 0
        for call in parsed.calls:
            result = await self.tools.call(call, timeout_s=self.timeout_s)
            failed += not result.ok
            lines.append(result.content if result.ok else f"error: {result.content}")
        lines += [f"error: {e}" for e in parsed.errors]
        info = {
            "tool_calls": len(parsed.calls),
            "tool_errors": failed,
            "malformed_calls": len(parsed.errors),
        }
        return StepResult("\n".join(lines), 0.0, False, info)
