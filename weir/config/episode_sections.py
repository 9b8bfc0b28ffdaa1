"""The config sections of agents, served sessions, multi-agent episodes, sandboxes and vision
inputs: the parts of the tree that shape what an episode is rather than how a step trains. Like
`weir.config.sections`, every field has a default, a range where one makes sense, and a docstring.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from weir.config.sections import Section


class ServeConfig(Section):
    """The OpenAI-compatible server (`weir serve`, `weir.serve`); see docs/serve.md."""

    host: str = "127.0.0.1"
    """Interface to listen on. Only this machine can connect unless you set e.g. 0.0.0.0."""
    port: int = Field(0, ge=0, le=65535)
    """TCP port; 0 picks a free one."""
    model_name: str | None = None
    """Model id reported by /v1/models and in responses; default: the model path's last part."""
    max_body_bytes: int = Field(1_000_000, ge=1024)
    """Larger request bodies are refused with 413."""
    max_messages: int = Field(256, ge=1)
    """Most messages in one chat request (400 beyond)."""
    max_tokens: int = Field(1024, ge=1)
    """Largest max_tokens a request may ask for (400 beyond)."""
    default_max_tokens: int = Field(256, ge=1)
    """max_tokens of a chat request that sets none (capped by max_tokens)."""
    max_n: int = Field(8, ge=1)
    """Most completions per request (requests in a recorded session must use n=1)."""
    tool_format: str = "hermes"
    """How the model writes tool calls (see agent.tool_format); parsed into `tool_calls`."""


class AgentConfig(Section):
    """Multi-turn episodes (`rollout.function: weir.rollout.multi_turn:rollout`); see docs/agents.md."""

    env: str | None = None
    """Dotted path to an environment class or factory (`reset(row)`, `step(action)`); null: the
    tools environment, which runs the tool calls in each model turn with `agent.tools`."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the environment factory."""
    tools: list[str] = Field(default_factory=list)
    """Tools of the tools environment: dotted paths `pkg.mod:fn` (or built-in tool names)."""
    tool_format: str = "hermes"
    """How the model writes calls, by model family: `hermes` (= `qwen2_5`, `qwen3`:
    `<tool_call>{"name":..,"arguments":{..}}</tool_call>`), `qwen3_coder` (XML parameters),
    `llama3_json`, `mistral` (`[TOOL_CALLS]`), `deepseek_v3`, `harmony` (GPT-OSS), `tag`
    (`<calc>12*34</calc>`, easy for tiny models), or a dotted path to a format of your own
    (docs/agents.md#tool-call-formats)."""
    show_tools: bool = True
    """Pass the tools' JSON schemas to the chat template (`tools=`) when building the prompt."""
    max_turns: int = Field(4, ge=1)
    """Most model turns per episode."""
    max_tokens: int = Field(256, ge=1)
    """Most response tokens per episode (model turns and observations); each turn also obeys
    rollout.max_new_tokens."""
    tool_timeout_s: float | None = Field(10.0, gt=0)
    """A tool call taking longer becomes an error observation."""
    play_cut_turns: bool = False
    """A turn cut at rollout.max_new_tokens is still passed to the environment (games and gym
    environments judge any text) instead of ending the episode as truncated."""
    env_timeout_s: float | None = Field(60.0, gt=0)
    """An environment's reset or step taking longer fails that episode (counted in
    agent/env_timeouts); a sync environment runs on a thread of its episode's own, so a hung one
    stalls no other episode."""
    reward: Literal["task", "env", "sum"] = "sum"
    """Sample reward: the reward function's (`task`), the discounted sum of the environment's
    per-step rewards (`env`), or both added (`sum`)."""
    turn_discount: float = Field(1.0, ge=0.0, le=1.0)
    """gamma in env_return = sum_t gamma^t r_t over the environment's per-step rewards."""


ROLE_SEP = "/"
"""Joins a role's name to another name: its policy's parameters when each role has its own
(`<role>/<parameter>`, weir.train.role_trainer and weir.engine.role_router) and its metrics.
`RoleConfig.name` cannot contain it."""


class RoleConfig(Section):
    """One role of a multi-agent episode."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$")
    """The role's name: it prefixes the role's turns in the other roles' views (`name: text`) and
    names its metrics (`reward/<name>/mean`)."""
    prompt: str | None = None
    """The role prompt, the system message of this role's view (null: data.system_prompt)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Most tokens of one turn of this role (null: rollout.max_new_tokens)."""
    model_path: str | None = None
    """multi_agent.policies=separate: the model this role's policy starts from (an HF directory or
    `tiny:` name with the run's tokenizer; null: model.path)."""


class MultiAgentConfig(Section):
    """Multi-agent episodes (`rollout.function: weir.rollout.multi_agent:rollout`): roles act in
    turn, each role's tokens trained with its own advantages; see docs/multi-agent.md."""

    roles: list[RoleConfig] = Field(default_factory=list)
    """The roles, each `{name, prompt, max_new_tokens}`: `name` labels its turns to the others
    (`name: text`) and its metrics; `prompt` is its role prompt (system message; null:
    data.system_prompt); `max_new_tokens` caps one of its turns (null: rollout.max_new_tokens);
    `model_path` (policies=separate) is the model its policy starts from (null: model.path).
    E.g. `[{name: proposer, prompt: propose the sum}, {name: checker, prompt: check it}]`."""
    turns: list[str] | None = None
    """Who acts when, by role name, e.g. `[debater_a, debater_b, debater_a, debater_b, judge]`
    (null: each role once, in the order of `roles`)."""
    scorer: str | None = None
    """Dotted path to `fn(episode, row) -> float | {"team": float, "<role>": float, ...}` (sync or
    async). null: the team reward is the reward function on the last turn, and there are no
    per-role rewards."""
    scorer_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments bound to the scorer."""
    credit: Literal["team", "role", "mixed"] = "team"
    """What each role's samples are trained on: the team's outcome (`team`), the role's own reward
    (`role`), or `team_weight * team + (1 - team_weight) * role` (`mixed`)."""
    team_weight: float = Field(0.5, ge=0.0, le=1.0)
    """The team reward's weight w under credit=mixed."""
    policies: Literal["shared", "separate"] = "shared"
    """`shared`: one policy plays every role, told apart by its role prompt. `separate`: each role
    has its own policy, a model, trainer (optimizer, schedule, reference) and engine of its own,
    trained on its own views only (cluster.type=local, engine.type=torch; docs/multi-agent.md)."""
    max_tokens: int = Field(256, ge=1)
    """Most response tokens of one role's view of an episode (its turns and the other roles' turns
    shown to it); also Dr.GRPO's constant normaliser for multi-agent runs."""

    @model_validator(mode="after")
    def _check_roles(self) -> MultiAgentConfig:
        names = [r.name for r in self.roles]
        if "team" in names:
            raise ValueError(
                "multi_agent.roles: 'team' names the team's reward (reward/team/mean); rename the role"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"multi_agent.roles: role names must be distinct, got {names}")
        unknown = sorted(set(self.turns or []) - set(names))
        if unknown:
            raise ValueError(
                f"multi_agent.turns names {unknown}, which are not in multi_agent.roles {names}"
            )
        if self.turns is not None and not self.turns:
            raise ValueError("multi_agent.turns is empty: list who acts when, or leave it null")
        with_path = [r.name for r in self.roles if r.model_path is not None]
        if with_path and self.policies != "separate":
            raise ValueError(
                f"multi_agent.roles {with_path} set model_path, which needs a policy per role: set "
                "multi_agent.policies=separate, or drop model_path"
            )
        if self.credit != "team" and self.scorer is None:
            raise ValueError(
                f"multi_agent.credit={self.credit} needs per-role rewards: set multi_agent.scorer "
                "to a function returning {'team': ..., '<role>': ...}, or use credit=team"
            )
        return self


class SandboxConfig(Section):
    """Where programs from responses run (code rewards, the `python` tool); see docs/code.md."""

    level: Literal["auto", "bwrap", "namespaces", "rlimit"] = "auto"
    """Isolation: `bwrap` (bubblewrap: own file system, no network, own PIDs), `namespaces` (unshare:
    no network, own PIDs, host files visible), `rlimit` (limits only); `auto` takes the strongest that
    works here (logged). A named level that cannot run stops the run at start."""
    max_parallel: int = Field(4, ge=1)
    """Executions at once; more wait for a slot (`reward/exec_queue_seconds`)."""
    wall_s: float = Field(10.0, gt=0)
    """Wall-clock limit of one execution (the program and the judge running all its tests)."""
    cpu_s: float = Field(5.0, gt=0)
    """CPU-time limit per process (RLIMIT_CPU)."""
    memory_mb: int = Field(512, ge=16)
    """Address-space limit per process (RLIMIT_AS), MiB."""
    processes: int = Field(16, ge=1)
    """Processes and threads a program may have at once, its main process included (RLIMIT_NPROC;
    exact at bwrap and namespaces, and at rlimit when weir runs as root)."""
    open_files: int = Field(64, ge=8)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    output_bytes: int = Field(1 << 20, ge=1024)
    """stdout and stderr are each cut here and the program killed; also the largest value a
    function of the program may return to the judge."""
    file_bytes: int = Field(8 << 20, ge=0)
    """Largest file a program may write (RLIMIT_FSIZE)."""
    disk_mb: int = Field(64, ge=1)
    """What each writable place holds, MiB: at `bwrap` the work directory, /tmp and /dev/shm are
    tmpfs mounts of this size (host memory); other levels bound files only one by one."""
    python: str | None = None
    """Interpreter for Python programs and their judges (3.9 or later); default: weir's own, or the
    system's where the sandbox uids cannot reach weir's."""
    python_guard: bool = True
    """Install the in-process audit hook that denies files outside the work directory, sockets,
    processes, signals and ctypes (defence in depth; the only guard at level `rlimit`)."""
    tmp_dir: str | None = None
    """Parent directory of the per-execution work directories (default: the system temp dir)."""


class VisionConfig(Section):
    """Prompts with images, for a vision-language model (docs/multimodal.md)."""

    image_key: str = "images"
    """Row field holding the prompt's images (one reference or a list: a file path, a data URL,
    bytes, or an HF `datasets` Image dict); they go before the text of the first user turn.
    Images may also come as content parts of a chat (`image_url` or `image`)."""
    allow_remote_urls: bool = False
    """Fetch `http(s)://` image URLs, in data rows and in the server's `image_url` parts. Off: such
    an image is refused (the row is skipped and counted; the server answers 400)."""
