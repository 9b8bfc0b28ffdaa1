"""Rollout: how prompts become scored groups (rollout functions, rewards, filters).

The entry points a loop of your own needs (examples/minimal_grpo.py uses them)::

    ctx = RolloutContext(engine=..., tokenizer=..., sampling=..., reward_fn=get_reward("numeric"),
                         encode=...)
    groups, metrics = collect_groups(ctx, rows, rollout)     # n scored samples per row
    metrics, groups = evaluate(ctx.with_sampling(n=1, temperature=0.0), rows, rollout)

They are imported when first used: a process that needs one module of the package (a Ray reward
worker unpickling `weir.rollout.rewards.numeric`) does not load weir's engine and transformers.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    "RolloutContext": "weir.rollout.single_turn",
    "collect_groups": "weir.rollout.collect",
    "evaluate": "weir.rollout.evaluate",
    "get_reward": "weir.rollout.rewards",
    "rollout": "weir.rollout.single_turn",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'weir.rollout' has no attribute {name!r}")


class _Package(types.ModuleType):
    """Keeps `weir.rollout.evaluate` the function when the module of the same name is imported.

    Importing a submodule sets it as an attribute of its package, which would hide the lazy
    export of the same name from `from weir.rollout import evaluate` in any process that had
    imported `weir.rollout.evaluate` (the module) first.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
