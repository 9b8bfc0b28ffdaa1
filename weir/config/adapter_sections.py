"""Config sections of the ecosystem adapters (`weir.adapters`): tasks and environments from
reasoning-gym, OpenEnv, textarena, gymnasium and verifiers, each behind its own section and
optional extra (``pip install 'weir[reasoning-gym]'`` ...); see docs/ecosystem.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from weir.config.sections import Section


class ReasoningGymConfig(Section):
    """reasoning-gym's procedural tasks as the data source, scored by their own verifiers."""

    dataset: str | None = None
    """A reasoning-gym task name (`basic_arithmetic`, `chain_sum`, `countdown`, ... any of its
    100+; `composite` mixes several). Set: its questions replace data.task and data.source, and
    its `score_answer` is the reward (unless reward.function is set)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Its config, passed through to `reasoning_gym.create_dataset` (difficulty options such as
    {min_terms: 2, max_terms: 2, max_digits: 1}); unknown keys are refused with the valid ones."""
    answer_tag: str | None = None
    """Score only the text inside the last `<tag>...</tag>` of the response (reasoning-gym's
    `extract_answer`; `answer` with its `SYSTEM_PROMPTS['default']`); null: the whole response."""
    disjoint_eval: bool = True
    """Drop training questions that also appear among the held-out ones (small task spaces repeat
    questions), so evaluation measures held-out questions."""


class GymnasiumConfig(Section):
    """A gymnasium environment as weir's env (`agent.env: gymnasium`)."""

    id: str | None = None
    """The environment id for `gymnasium.make`, e.g. `FrozenLake-v1`; a module to import first
    may prefix it, `my_pkg.envs:MyEnv-v0`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for `gymnasium.make` (e.g. {is_slippery: false})."""
    observation: str | None = None
    """Dotted path to `fn(observation, info, env) -> str`; null: a text observation as is, a
    discrete one (and FrozenLake/CliffWalking/Taxi grids) rendered by weir's formatter."""
    action: str | None = None
    """Dotted path to `fn(text, env) -> action`; null: a Text action space takes the text, a
    Discrete one the first integer in it or an action name from `action_names`."""
    action_names: list[str] = Field(default_factory=list)
    """Names of a Discrete space's actions in order (e.g. [left, down, right, up]); the model may
    answer with a name or the number."""
    invalid_action_reward: float = 0.0
    """Reward of a turn whose text names no valid action (the episode goes on; counted in
    agent/invalid_actions)."""
    max_episode_steps: int | None = Field(None, ge=1)
    """Passed to `gymnasium.make`; null: the environment's own limit."""


class OpenEnvConfig(Section):
    """An OpenEnv environment (openenv-core) as weir's env (`agent.env: openenv`)."""

    env: str | None = None
    """Dotted path to the OpenEnv `Environment` subclass (in process), e.g. `my_pkg.server:MyEnv`."""
    action: str | None = None
    """Dotted path to its `Action` class; null: the `Action` type of its `step` signature."""
    observation_cls: str | None = None
    """Dotted path to its `Observation` class (needed by the HTTP server); null: from `reset`'s
    return annotation."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the environment class."""
    mode: Literal["in_process", "http"] = "in_process"
    """`in_process`: one environment object per episode. `http`: the run starts OpenEnv's HTTP
    server (`create_app`, uvicorn) in a child process and each episode is a session over it."""
    url: str | None = None
    """mode=http: attach to a running server at this URL instead of starting one."""
    action_field: str | None = None
    """The Action field that receives the model's text; null: its only required str field."""
    observation_field: str | None = None
    """The Observation field shown to the model; null: the first str field that is not `reward`,
    `done` or `metadata`, else the observation's JSON."""
    startup_timeout_s: float = Field(60.0, gt=0)
    """mode=http: how long the started server may take to answer."""


class TextArenaConfig(Section):
    """A textarena game as a multi-agent episode (`rollout.function:
    weir.adapters.textarena:rollout`): each player is a role of multi_agent.roles."""

    env_id: str | None = None
    """A textarena environment id, e.g. `TicTacToe-v0`, `Nim-v0`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for `textarena.make`."""
    max_turns: int = Field(20, ge=1)
    """Most turns of one episode (all players together); an unfinished game is a draw
    (`truncated`)."""
    observation: Literal["full", "last"] = "last"
    """What a player is shown at its turn: its whole textarena observation (`full`), or only what
    is new since its last turn (`last`, shorter; its first turn shows everything so far)."""
    draw_reward: float | None = None
    """Reward of each player in a game cut at max_turns; null: textarena's own (0 for a draw)."""


class VerifiersConfig(Section):
    """A `verifiers` environment as the rollout and reward (`rollout.function:
    weir.adapters.verifiers:rollout`): its dataset the prompts, its turns played by weir's engine,
    its rubric the reward; see docs/ecosystem.md#verifiers."""

    env: str | None = None
    """A dotted path `pkg.mod:fn` to a function returning a `vf.Environment`, or the id of a
    verifiers environment installed as a package (`vf.load_environment`), e.g. `vf-gsm8k`."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for that function (or the package's `load_environment`)."""
