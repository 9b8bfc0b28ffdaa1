"""Built-in tasks: data generators, SFT targets and default rewards.

``get_task("arithmetic").make_rows("train", 1000, seed=0, digits=2)`` gives prompt rows;
``.sft_rows(n, seed)`` gives rows with a target ``"response"`` for a supervised warm start;
``.reward`` is a name or dotted path for `weir.rollout.rewards.get_reward`.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["TaskSpec", "TASKS", "get_task"]

NAMES = (
    "arithmetic",
    "countdown",
    "gsm8k",
    "calculator",
    "code",
    "humaneval",
    "proposer_checker",
    "relay",
    "shapes",
    "gui",
)
"""The built-in tasks, each the module weir.tasks.NAME. A task's module is imported when it is
asked for: a process that scores `weir.tasks.arithmetic`'s reward does not load the GUI task's
renderer or the calculator's rollout (and with it weir's engine and transformers)."""


@dataclass(frozen=True)
class TaskSpec:
    """A built-in task.

    make_rows(split, n, seed, **options) -> rows with "prompt" and "answer"
    sft_rows(n, seed, **options) -> rows with "prompt" and "response"
    reward: a reward name or dotted path (for `get_reward`)
    """

    name: str
    make_rows: Callable[..., list[dict[str, Any]]]
    sft_rows: Callable[..., list[dict[str, Any]]]
    reward: str
    description: str


@functools.cache
def _spec(name: str) -> TaskSpec:
    m = importlib.import_module(f"weir.tasks.{name}")
    return TaskSpec(
        name=name,
        make_rows=m.make_rows,
        sft_rows=m.sft_rows,
        reward=m.REWARD,
        description=m.DESCRIPTION,
    )


def get_task(name: str) -> TaskSpec:
    """The task called `name`; an unknown name raises ValueError listing the valid ones."""
    if name in NAMES:
        return _spec(name)
    nearest = difflib.get_close_matches(str(name), list(NAMES), n=1)
    hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
    raise ValueError(f"unknown task {name!r}: valid tasks are {sorted(NAMES)}{hint}")


def __getattr__(name: str) -> Any:
    if name == "TASKS":  # every task, by name (imports them all)
        return {n: _spec(n) for n in NAMES}
    raise AttributeError(f"module 'weir.tasks' has no attribute {name!r}")
