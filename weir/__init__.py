"""weir: reinforcement-learning post-training of language models, from a laptop CPU to a Ray cluster.

From Python (notebooks included)::

    import weir
    cfg = weir.load_config("examples/arithmetic.yaml", ["rollout.n=8"])
    result = weir.run(cfg, reward=my_reward)          # plugins as objects or dotted paths
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weir.config import Config
    from weir.loop import RunResult

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Config helpers load on first use, so `import weir.algo` stays torch-only."""
    if name in ("Config", "ConfigError", "build_config", "load_config"):
        import weir.config

        return getattr(weir.config, name)
    raise AttributeError(f"module 'weir' has no attribute {name!r}")


def _as_config(config: Config | dict[str, Any] | str | Path, overrides: list[str] | None) -> Config:
    from weir.config import Config, build_config, load_config

    if isinstance(config, Config):
        return build_config(config.model_dump(), overrides) if overrides else config
    if isinstance(config, dict):
        return build_config(config, overrides)
    return load_config(config, overrides)


def run(
    config: Config | dict[str, Any] | str | Path,
    overrides: list[str] | None = None,
    *,
    reward: Callable | None = None,
    rollout: Callable | None = None,
    filter: Callable | None = None,
) -> RunResult:
    """Train with RL (the loop `loop.mode` names). `config` is a Config, a dict of sections, or a YAML path."""
    from weir.loop import train

    return train(_as_config(config, overrides), reward=reward, rollout=rollout, filter=filter)


def sft(config: Config | dict[str, Any] | str | Path, overrides: list[str] | None = None) -> Path:
    """Supervised warm start; returns the saved model directory."""
    from weir.loop.sft import run_sft

    return run_sft(_as_config(config, overrides))


__all__ = ["Config", "ConfigError", "build_config", "load_config", "run", "sft"]
