"""`agent_rollout`: turn an agent written against the OpenAI API into a weir rollout function.

    def my_agent(base_url: str, api_key: str, row: dict) -> float | None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        ...                                  # any number of chat calls, tools, ...
        return reward                        # optional; or POST /v1/sessions/{id}/reward

    rollout = agent_rollout(my_agent)         # config: rollout.function: my_pkg.agents:rollout

For each row the rollout opens `n` = rollout.n sessions on a server in front of the run's engine
(started once per engine, on 127.0.0.1), runs the agent once per session (a sync agent in a worker
thread, an async one on the loop), and returns the `Group` of the sessions' samples. The session's
sampling is forced to the run's (temperature, top-p, top-k, rollout.max_new_tokens as a per-call
cap) so that the recorded log-probs follow the trainer's convention whatever the agent asks for;
a seeded rollout (evaluation) seeds each session and call, so its samples are reproducible when
the agent is. The server's limits come from `config=`, else ``ctx.extras["serve"]`` (a
`ServeConfig`), else the defaults.

Reward, first that applies: set on the session (HTTP or `Session.set_reward`), the number the agent
returns, else the run's reward function on the sample. An agent that raises or times out gives a
FAILED sample (counted by the loop, never fatal). A session whose agent rewrote its history has
several segments; each becomes a sample with the session's reward (`segments="last"` keeps only the
final one).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import numbers
import threading
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Literal

from weir.config.schema import ServeConfig
from weir.data.sample import Group, Sample, Status
from weir.rollout.rewards import score
from weir.rollout.single_turn import RolloutContext
from weir.serve.server import Server
from weir.serve.sessions import Session

Agent = Callable[[str, str, dict], Any]

_servers: dict[int, tuple[Any, Server]] = {}
_servers_mu = threading.Lock()


def server_for(engine: Any, tokenizer: Any, config: ServeConfig | None = None) -> Server:
    """The server in front of `engine` (started on first use, then shared by every rollout)."""
    with _servers_mu:
        for key, (eng, srv) in list(_servers.items()):
            if getattr(eng, "_closed", False):  # a finished run's TorchEngine: free its server
                srv.stop()
                del _servers[key]
        entry = _servers.get(id(engine))
        if entry is None or entry[0] is not engine:
            entry = (engine, Server(engine, tokenizer, config).start())
            _servers[id(engine)] = entry
        return entry[1]


def stop_servers() -> None:
    """Stop every server `agent_rollout` started (they are daemon threads; this frees them early)."""
    with _servers_mu:
        for _, srv in _servers.values():
            srv.stop()
        _servers.clear()


def agent_rollout(
    agent: Agent,
    *,
    timeout_s: float | None = 600.0,
    config: ServeConfig | None = None,
    segments: Literal["all", "last"] = "all",
) -> Callable[[RolloutContext, dict], Awaitable[Group]]:
    """A rollout function ``async (ctx, row) -> Group`` that runs `agent(base_url, api_key, row)`
    in ``ctx.sampling.n`` recorded sessions (see the module docstring)."""
    if segments not in ("all", "last"):
        raise ValueError(f"segments must be 'all' or 'last', got {segments!r}")

    async def rollout(ctx: RolloutContext, row: dict) -> Group:
        server = server_for(ctx.engine, ctx.tokenizer, config or ctx.extras.get("serve"))
        loop = asyncio.get_running_loop()
        sessions = [
            server.sessions.open(
                row,
                metadata={"session_index": i},
                sampling=replace(ctx.sampling, n=1, seed=_session_seed(ctx.sampling.seed, row, i)),
                loop=loop,
            )
            for i in range(ctx.sampling.n)
        ]
        try:
            outcomes = await asyncio.gather(*(_run(agent, s, row, timeout_s) for s in sessions))
        finally:
            for s in sessions:
                server.sessions.remove(s)
        samples: list[Sample] = []
        for s, (returned, error) in zip(sessions, outcomes, strict=True):
            samples += await _samples(ctx, row, s, returned, error, segments)
        for i, sample in enumerate(samples):
            sample.index = i
        return Group(samples=samples, row=row)

    return rollout


def _session_seed(seed: int | None, row: dict, index: int) -> int | None:
    """A seeded rollout (e.g. evaluation) gives each (row, session) its own seed; the server
    derives each call's seed from it and the call's position in the session."""
    if seed is None:
        return None
    row_index = row.get("_index")
    row_index = row_index if isinstance(row_index, int) else 0
    return (seed * 1_000_003 + row_index * 7_919 + index) % 2**63


def _in_thread(fn: Callable, *args: Any) -> asyncio.Future:
    """Run `fn(*args)` in its own daemon thread (not the loop's bounded default executor, which
    would queue agents beyond its few workers and make the loop's shutdown wait for a stuck one)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    def target() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as err:  # handed to the awaiting task
            value, error = None, err
        # RuntimeError: the loop is gone, and nobody waits for this agent any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=target, name="weir-agent", daemon=True).start()
    return fut


async def _run(agent: Agent, session: Session, row: dict, timeout_s: float | None):
    """(what the agent returned, None) or (None, error message)."""
    try:
        if inspect.iscoroutinefunction(agent):
            call = agent(session.base_url, session.api_key, row)
        else:
            call = _in_thread(agent, session.base_url, session.api_key, row)
        return await asyncio.wait_for(call, timeout_s), None
    except asyncio.TimeoutError:
        return None, f"AgentError: timeout: the agent ran longer than {timeout_s} s"
    except Exception as err:  # a user agent must not end the run
        return None, f"AgentError: {type(err).__name__}: {err}"
    finally:
        session.close()


async def _samples(
    ctx: RolloutContext,
    row: dict,
    session: Session,
    returned: Any,
    error: str | None,
    segments: str,
) -> list[Sample]:
    samples = session.to_samples()
    if segments == "last":
        samples = samples[-1:]
    if not samples:
        try:
            prompt = ctx.encode(row)
        except Exception:
            prompt = []
        why = error or "AgentError: the agent made no model call"
        return [Sample(prompt_ids=prompt, status=Status.FAILED, error=why, row=row)]
    for s in samples:
        s.prompt_text = ctx.tokenizer.decode(s.prompt_ids, skip_special_tokens=True)
        s.response_text = ctx.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        if error is not None:
            s.status, s.error, s.reward = Status.FAILED, error, None
            continue
        if s.reward is not None:
            continue
        if (
            isinstance(returned, numbers.Real)
            and not isinstance(returned, bool)
            and math.isfinite(returned)
        ):
            s.reward = float(returned)
            s.reward_info = {"reward": s.reward, "source": "agent"}
        else:
            await score(ctx.reward_fn, s, row, timeout_s=ctx.reward_timeout_s)
    return samples
