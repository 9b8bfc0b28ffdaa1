"""OpenEnv (``pip install 'weir[openenv]'``): an OpenEnv environment as weir's env, in process or
behind OpenEnv's own HTTP server started by the run.

```yaml
rollout: {function: weir.rollout.multi_turn:rollout}
agent: {env: openenv, reward: env, max_turns: 2}
openenv:
  env: echo_env.server.echo_env_environment:EchoEnvironment
  action: echo_env.models:EchoAction
  mode: http                      # or in_process
```

An OpenEnv ``Environment`` has ``reset(seed=..., episode_id=...) -> Observation`` and
``step(action) -> Observation``, observations being pydantic models with ``done``, ``reward`` and
``metadata``. An episode: ``reset`` (with the row's ``env_seed`` when ``reset`` takes a seed), then
one ``step`` per model turn with the turn's text in the action's text field
(``openenv.action_field``, default: its only required ``str`` field); the observation's text field
(``openenv.observation_field``, default: its first ``str`` field) is what the model sees next,
its ``reward`` the step's reward, ``done`` ends the episode.

``mode: http`` starts ``uvicorn`` over OpenEnv's ``create_fastapi_app`` in a child process when the
run starts (or attaches to ``openenv.url``) and plays each episode as a WebSocket session of
OpenEnv's ``GenericEnvClient``; the server is stopped when the run's process exits. Episodes run
concurrently, so the environment must declare ``SUPPORTS_CONCURRENT_SESSIONS = True`` (else the
server takes one session at a time and the others fail: use ``in_process``). Failures of the
environment or the connection fail that episode (``EnvError``, counted), never the run.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weir.plugins import import_path
from weir.rollout.env import StepResult

__all__ = ["env_factory", "OpenEnvEpisode", "HttpEpisode", "serve_main"]

_SKIP = {"done", "reward", "metadata"}


def _require() -> None:
    try:
        import openenv.core.env_server  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "agent.env=openenv needs openenv-core: pip install 'weir[openenv]'"
            f" ({type(e).__name__}: {e})"
        ) from e


def _classes(section: Any) -> tuple[type, type, type]:
    """The environment, action and observation classes the section names (the last two from the
    environment's annotations when not given)."""
    env_cls = import_path(section.env, kind="openenv.env")
    hints: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        hints = {
            "step": typing.get_type_hints(env_cls.step),
            "reset": typing.get_type_hints(env_cls.reset),
        }
    action = (
        import_path(section.action, kind="openenv.action")
        if section.action
        else hints.get("step", {}).get("action")
    )
    obs = (
        import_path(section.observation_cls, kind="openenv.observation_cls")
        if section.observation_cls
        else hints.get("reset", {}).get("return")
    )
    if not isinstance(action, type) or not hasattr(action, "model_fields"):
        raise ValueError(
            f"openenv.env={section.env!r}: cannot tell its Action class from step()'s annotation; "
            "set openenv.action to its dotted path"
        )
    if not isinstance(obs, type) or not hasattr(obs, "model_fields"):
        raise ValueError(
            f"openenv.env={section.env!r}: cannot tell its Observation class from reset()'s "
            "annotation; set openenv.observation_cls to its dotted path"
        )
    return env_cls, action, obs


def _action_field(section: Any, action_cls: type) -> str:
    if section.action_field is not None:
        if section.action_field not in action_cls.model_fields:
            raise ValueError(
                f"openenv.action_field={section.action_field!r} is not a field of "
                f"{action_cls.__name__} ({sorted(action_cls.model_fields)})"
            )
        return section.action_field
    text = [
        n
        for n, f in action_cls.model_fields.items()
        if f.annotation is str and f.is_required() and n not in _SKIP
    ]
    if len(text) != 1:
        raise ValueError(
            f"{action_cls.__name__} has {len(text)} required str fields ({text}); set "
            "openenv.action_field to the one that takes the model's text"
        )
    return text[0]


def _observation_text(obs: Any, field: str | None) -> str:
    """The text shown to the model from an observation (a pydantic model or, over HTTP, a dict)."""
    data = obs.model_dump() if hasattr(obs, "model_dump") else obs
    if not isinstance(data, dict):
        raise TypeError(
            f"an OpenEnv observation must be a model or a dict, got {type(obs).__name__}"
        )
    if field is not None:
        if field not in data:
            raise KeyError(f"the observation has no field {field!r} (it has {sorted(data)})")
        return str(data[field])
    for k, v in data.items():
        if k not in _SKIP and isinstance(v, str):
            return v
    return json.dumps({k: v for k, v in data.items() if k not in _SKIP}, default=str)


class OpenEnvEpisode:
    """One in-process OpenEnv environment for one episode (weir's env protocol)."""

    def __init__(self, section: Any, env_cls: type, action_cls: type, field: str) -> None:
        self.section, self.action_cls, self.field = section, action_cls, field
        self.env = env_cls(**section.kwargs)

    def reset(self, row: dict) -> str:
        kwargs = {}
        params = inspect.signature(self.env.reset).parameters
        if row.get("env_seed") is not None and (
            "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        ):
            kwargs["seed"] = int(row["env_seed"])
        return _observation_text(self.env.reset(**kwargs), self.section.observation_field)

    def step(self, action_text: str) -> StepResult:
        obs = self.env.step(self.action_cls(**{self.field: action_text}))
        done = bool(obs.done)
        text = None if done else _observation_text(obs, self.section.observation_field)
        return StepResult(text, float(obs.reward or 0.0), done, {})

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


class HttpEpisode:
    """One episode as a session of OpenEnv's WebSocket client on a running server."""

    def __init__(self, section: Any, url: str, field: str) -> None:
        from openenv.core.generic_client import GenericEnvClient

        self.section, self.field = section, field
        self.client = GenericEnvClient(base_url=url, message_timeout_s=section.startup_timeout_s)

    async def reset(self, row: dict) -> str:
        await self.client.connect()
        seed = row.get("env_seed")
        result = await self.client.reset(**({} if seed is None else {"seed": int(seed)}))
        return _observation_text(result.observation, self.section.observation_field)

    async def step(self, action_text: str) -> StepResult:
        result = await self.client.step({self.field: action_text})
        done = bool(result.done)
        text = (
            None if done else _observation_text(result.observation, self.section.observation_field)
        )
        return StepResult(text, float(result.reward or 0.0), done, {})

    async def close(self) -> None:
        await self.client.close()


_SERVERS: dict[str, tuple[subprocess.Popen, str]] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(section: Any) -> str:
    """Start (once per process and environment) OpenEnv's HTTP server for `section` in a child
    process; returns its URL once it answers /health. Stopped when this process exits."""
    key = json.dumps(section.model_dump(), sort_keys=True, default=str)
    if key in _SERVERS and _SERVERS[key][0].poll() is None:
        return _SERVERS[key][1]
    port = _free_port()
    spec = {
        "env": section.env,
        "action": section.action,
        "observation": section.observation_cls,
        "kwargs": section.kwargs,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    fd, log_path = tempfile.mkstemp(prefix="weir-openenv-", suffix=".log")
    with os.fdopen(fd, "wb") as log:  # output to a file: a full pipe would stall the server
        proc = subprocess.Popen(
            [sys.executable, "-m", "weir.adapters.openenv", json.dumps(spec), str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    log = Path(log_path)
    atexit.register(log.unlink, missing_ok=True)
    atexit.register(_stop, proc)  # runs before the log's removal (last registered, first run)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + section.startup_timeout_s
    import httpx

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = log.read_text(errors="replace").strip().splitlines()
            raise RuntimeError(
                f"the OpenEnv server for {section.env!r} exited at start: "
                f"{err[-1] if err else 'no message'}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                _SERVERS[key] = (proc, url)
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    _stop(proc)
    raise RuntimeError(
        f"the OpenEnv server for {section.env!r} did not answer within "
        f"openenv.startup_timeout_s={section.startup_timeout_s} s"
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def env_factory(section: Any) -> Callable[[], Any]:
    """A function making one episode's environment; checks the classes now, and with
    ``mode: http`` starts the server (or checks ``openenv.url``), so problems stop the run at its
    start with one line."""
    if section.env is None:
        raise ValueError("agent.env=openenv needs openenv.env (dotted path to the Environment)")
    _require()
    env_cls, action_cls, _ = _classes(section)
    field = _action_field(section, action_cls)
    if section.mode == "in_process":
        OpenEnvEpisode(section, env_cls, action_cls, field).close()
        return lambda: OpenEnvEpisode(section, env_cls, action_cls, field)
    url = section.url or _start_server(section)
    return lambda: HttpEpisode(section, url, field)


def serve_main(spec_json: str, port: int) -> None:
    """The child process of ``mode: http``: OpenEnv's FastAPI app on 127.0.0.1:`port`."""
    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app

    spec = json.loads(spec_json)
    section = type(
        "S",
        (),
        {"env": spec["env"], "action": spec["action"], "observation_cls": spec["observation"]},
    )()
    env_cls, action_cls, obs_cls = _classes(section)
    kwargs = spec["kwargs"]
    sessions = 1024 if getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
    app = create_fastapi_app(
        lambda: env_cls(**kwargs), action_cls, obs_cls, max_concurrent_envs=sessions
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    serve_main(sys.argv[1], int(sys.argv[2]))
