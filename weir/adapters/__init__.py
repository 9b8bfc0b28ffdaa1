"""Tasks and environments from the ecosystem, each behind its config section and optional extra:

| section | library (extra) | what it becomes in weir |
| --- | --- | --- |
| `reasoning_gym` | reasoning-gym (`reasoning-gym`) | the prompts and the reward (`weir.adapters.reasoning_gym`) |
| `gymnasium` | gymnasium (`gymnasium`) | the env of multi-turn episodes, `agent.env: gymnasium` |
| `openenv` | openenv-core (`openenv`) | the env, in process or over its HTTP server, `agent.env: openenv` |
| `textarena` | textarena (`textarena`) | a multi-agent episode, one role per player |
| `verifiers` | verifiers (`verifiers`) | the prompts, the rollout and the reward (`weir.adapters.verifiers`) |

The loop asks this module for the rows (`adapter_rows`), the default reward (`adapter_reward`;
`adapter_scores`: the adapter's rollout scores its samples itself), the SFT rows
(`adapter_sft_rows`) and what the rollout functions read (`adapter_extras`); each library is
imported only when its section is used. See docs/ecosystem.md.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "adapter_rows",
    "adapter_reward",
    "adapter_reward_kwargs",
    "adapter_scores",
    "adapter_sft_rows",
    "adapter_extras",
]


def _seed_rows(label: str, n: int, seed: int) -> list[dict[str, Any]]:
    """Rows for an environment that makes its own episodes: one reset seed each."""
    return [{"prompt": label, "answer": "", "env_seed": seed + i} for i in range(n)]


def adapter_rows(cfg: Any, split: str) -> list[dict[str, Any]] | None:
    """The rows of `split` from an adapter section, or None when no adapter provides data (then
    data.source or data.task does). data.source / data.eval_source, when set, win."""
    if (cfg.data.source if split == "train" else cfg.data.eval_source) is not None:
        return None
    n = cfg.data.train_size if split == "train" else cfg.data.eval_size
    seed = cfg.run.seed if split == "train" else cfg.run.seed + 10_000
    if cfg.reasoning_gym.dataset is not None:
        from weir.adapters import reasoning_gym

        return reasoning_gym.rows(cfg.reasoning_gym, split, n, cfg.run.seed, cfg.data.eval_size)
    if cfg.verifiers.env is not None:
        from weir.adapters import verifiers

        return verifiers.rows(cfg.verifiers, split, n, cfg.data.eval_size)
    if cfg.textarena.env_id is not None:
        return _seed_rows(cfg.textarena.env_id, n, seed)
    if cfg.agent.env == "gymnasium" and cfg.gymnasium.id is not None:
        return _seed_rows(cfg.gymnasium.id, n, seed)
    if cfg.agent.env == "openenv" and cfg.openenv.env is not None:
        return _seed_rows(cfg.openenv.env, n, seed)
    return None


def adapter_reward(cfg: Any) -> str | None:
    """The reward an adapter section implies (reasoning-gym's verifier), or None."""
    if cfg.reasoning_gym.dataset is not None:
        return "weir.adapters.reasoning_gym:score"
    return None


def adapter_scores(cfg: Any) -> bool:
    """Whether an adapter's rollout scores its own samples (a verifiers environment's rubric),
    so the run needs no reward function."""
    return cfg.verifiers.env is not None


def adapter_reward_kwargs(cfg: Any) -> dict[str, Any]:
    if cfg.reasoning_gym.dataset is not None and cfg.reasoning_gym.answer_tag is not None:
        return {"answer_tag": cfg.reasoning_gym.answer_tag}
    return {}


def adapter_sft_rows(cfg: Any) -> list[dict[str, Any]] | None:
    """SFT rows from an adapter section (reasoning-gym: its answers, `sft.task_options.corrupt`
    of them replaced by wrong ones), or None."""
    if cfg.reasoning_gym.dataset is None or cfg.sft.data is not None:
        return None
    from weir.adapters import reasoning_gym

    options = dict(cfg.sft.task_options)
    return reasoning_gym.sft_rows(
        cfg.reasoning_gym,
        cfg.sft.rows,
        cfg.run.seed,
        corrupt=float(options.pop("corrupt", 0.0)),
        eval_size=cfg.data.eval_size,
    )


def adapter_extras(cfg: Any) -> dict[str, Any]:
    """What the adapters' rollout functions read from ``ctx.extras``: their sections (verifiers:
    its environment loaded and checked against the run's settings), and, for
    `agent.env: gymnasium | openenv`, the factory of one episode's environment (checked now, so a
    bad section stops the run at its start with one line)."""
    extras: dict[str, Any] = {}
    if cfg.agent.env == "gymnasium":
        from weir.adapters import gymnasium

        extras["env_factory"] = gymnasium.env_factory(cfg.gymnasium)
    elif cfg.agent.env == "openenv":
        from weir.adapters import openenv

        extras["env_factory"] = openenv.env_factory(cfg.openenv)
    if cfg.textarena.env_id is not None:
        from weir.adapters import textarena

        extras["textarena"] = textarena.check(cfg.textarena, cfg.multi_agent)
    if cfg.verifiers.env is not None:
        from weir.adapters import verifiers

        extras["verifiers"] = verifiers.check_run(cfg)
    return extras
