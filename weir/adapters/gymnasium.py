"""gymnasium (``pip install 'weir[gymnasium]'``): any gymnasium environment as weir's env.

```yaml
rollout: {function: weir.rollout.multi_turn:rollout}
agent: {env: gymnasium, reward: env, max_turns: 8}
gymnasium:
  id: FrozenLake-v1
  kwargs: {is_slippery: false}
```

An episode is ``env.reset(seed=row["env_seed"])`` then one ``env.step`` per model turn: the
model's text becomes the action, the next observation becomes the text it sees, the step's
reward is weir's per-step reward (``agent.reward: env`` trains on their discounted sum) and
``terminated or truncated`` ends the episode.

Text both ways: a ``Text`` observation is shown as is; otherwise, when the environment renders
``ansi`` text (gymnasium's toy-text games do; it is asked for when ``render_mode`` is not set),
that grid, with the highlighted cell in brackets, plus the observation; else the observation
itself. A ``Text`` action space takes the model's text; a ``Discrete`` one the first action name
(``action_names``, defaults for FrozenLake, CliffWalking and Taxi) or integer in it. Text that
is no valid action gives ``invalid_action_reward``, the same observation again with a note, and
counts in ``agent/invalid_actions``. Your own ``observation`` / ``action`` functions (dotted
paths) replace either side.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from weir.plugins import resolve
from weir.rollout.env import StepResult

__all__ = ["GymTextEnv", "env_factory", "ansi_text", "DEFAULT_ACTION_NAMES"]

DEFAULT_ACTION_NAMES = {
    "FrozenLake": ["left", "down", "right", "up"],
    "CliffWalking": ["up", "right", "down", "left"],
    "Taxi": ["south", "north", "east", "west", "pickup", "dropoff"],
}
_HIGHLIGHT = re.compile(r"\x1b\[[0-9;]*m(.)\x1b\[0m")
_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_INT = re.compile(r"-?\d+")


def _gym() -> Any:
    try:
        import gymnasium
    except ImportError as e:
        raise ImportError(
            "agent.env=gymnasium needs the gymnasium package: pip install 'weir[gymnasium]'"
        ) from e
    return gymnasium


def ansi_text(rendered: str) -> str:
    """An ``ansi`` rendering as plain text: a highlighted cell in brackets, escapes removed."""
    return _ESCAPE.sub("", _HIGHLIGHT.sub(r"[\1]", rendered)).strip("\n")


def _make(section: Any) -> Any:
    gym = _gym()
    env_id = section.id
    if ":" in env_id:  # my_pkg.envs:MyEnv-v0 registers its environments on import
        module, env_id = env_id.split(":", 1)
        importlib.import_module(module)
    kwargs = dict(section.kwargs)
    if section.max_episode_steps is not None:
        kwargs["max_episode_steps"] = section.max_episode_steps
    try:
        spec = gym.spec(env_id)
    except Exception as e:
        raise ValueError(f"gymnasium.id={section.id!r}: {type(e).__name__}: {e}") from None
    modes = (getattr(spec, "kwargs", None) or {}).get("render_modes")  # rarely in the spec
    if "render_mode" not in kwargs and (modes is None or "ansi" in modes):
        kwargs["render_mode"] = "ansi"
    try:
        return gym.make(env_id, **kwargs)
    except Exception as e:
        if kwargs.get("render_mode") == "ansi" and "render_mode" not in section.kwargs:
            kwargs.pop("render_mode")
            return gym.make(env_id, **kwargs)
        raise ValueError(
            f"gymnasium.make({section.id!r}) failed: {type(e).__name__}: {e}"
        ) from None


class GymTextEnv:
    """One gymnasium environment for one episode, speaking text (weir's env protocol)."""

    def __init__(
        self,
        section: Any,
        observation: Callable[..., str] | None = None,
        action: Callable[..., Any] | None = None,
    ) -> None:
        gym = _gym()
        self.section = section
        self.env = _make(section)
        self._observation = observation
        self._action = action
        space = self.env.action_space
        self._text_actions = isinstance(space, gym.spaces.Text)
        self._discrete = isinstance(space, gym.spaces.Discrete)
        names = list(section.action_names)
        if not names and self._discrete:
            base = section.id.split(":")[-1].split("-")[0]
            names = DEFAULT_ACTION_NAMES.get(base, [])
        self.action_names = [n.lower() for n in names]
        self._last = ""

    def _text(self, obs: Any, info: dict) -> str:
        if self._observation is not None:
            text = self._observation(obs, info, self.env)
            if not isinstance(text, str):
                raise TypeError(
                    f"gymnasium.observation returned {type(text).__name__}, expected a str"
                )
            return text
        if isinstance(obs, str):
            return obs
        rendered = None
        if getattr(self.env, "render_mode", None) == "ansi":
            rendered = self.env.render()
        if isinstance(rendered, str) and rendered.strip():
            text = ansi_text(rendered)
        else:
            text = f"observation: {obs.tolist() if hasattr(obs, 'tolist') else obs}"
        if self.action_names:
            text += "\nactions: " + ", ".join(self.action_names)
        return text

    def parse_action(self, text: str) -> Any | None:
        """The action `text` names, or None when it names none."""
        if self._action is not None:
            return self._action(text, self.env)
        space = self.env.action_space
        if self._text_actions:
            action = text.strip()
            return action if space.contains(action) else None
        if not self._discrete:
            raise TypeError(
                f"gymnasium.id={self.section.id!r} has a {type(space).__name__} action space; "
                "set gymnasium.action to a function turning the model's text into an action"
            )
        lowered = text.lower()
        hits = [(lowered.find(n), i) for i, n in enumerate(self.action_names) if n in lowered]
        if hits:
            return int(space.start) + min(hits)[1]
        m = _INT.search(text)
        if m is not None:
            value = int(m.group())
            if space.contains(space.dtype.type(value)):
                return value
        return None

    def reset(self, row: dict) -> str:
        seed = row.get("env_seed")
        obs, info = self.env.reset(seed=None if seed is None else int(seed))
        self._last = self._text(obs, info)
        return self._last

    def step(self, action_text: str) -> StepResult:
        action = self.parse_action(action_text)
        if action is None:
            note = "that is not a valid action"
            if self.action_names:
                note += f"; answer with one of: {', '.join(self.action_names)}"
            reward = float(self.section.invalid_action_reward)
            return StepResult(f"{note}\n{self._last}", reward, False, {"invalid_actions": 1})
        obs, reward, terminated, truncated, info = self.env.step(action)
        done = bool(terminated or truncated)
        self._last = "" if done else self._text(obs, info)
        return StepResult(None if done else self._last, float(reward), done, {})

    def close(self) -> None:
        self.env.close()


def env_factory(section: Any) -> Callable[[], GymTextEnv]:
    """A function making one episode's environment; builds one now, so that a missing package, an
    unknown id or bad kwargs stop the run at its start with one line."""
    if section.id is None:
        raise ValueError("agent.env=gymnasium needs gymnasium.id (e.g. FrozenLake-v1)")
    observation = (
        resolve(section.observation, {}, "gymnasium.observation") if section.observation else None
    )
    action = resolve(section.action, {}, "gymnasium.action") if section.action else None
    GymTextEnv(section, observation, action).close()
    return lambda: GymTextEnv(section, observation, action)
