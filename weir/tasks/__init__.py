"""Built-in tasks: data generators, SFT targets and default rewards.

``get_task("arithmetic").make_rows("train", 1000, seed=0, digits=2)`` gives prompt rows;
``.sft_rows(n, seed)`` gives rows with a target ``"response"`` for a supervised warm start;
``.reward`` is a name or dotted path for `weir.rollout.rewards.get_reward`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weir.tasks import (
    arithmetic,
    calculator,
    code,
    countdown,
    gsm8k,
    gui,
    humaneval,
    proposer_checker,
    relay,
    shapes,
)

__all__ = ["TaskSpec", "TASKS", "get_task"]


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


TASKS: dict[str, TaskSpec] = {
    m.__name__.rsplit(".", 1)[1]: TaskSpec(
        name=m.__name__.rsplit(".", 1)[1],
        make_rows=m.make_rows,
        sft_rows=m.sft_rows,
        reward=m.REWARD,
        description=m.DESCRIPTION,
    )
    for m in (
        arithmetic,
        countdown,
        gsm8k,
        calculator,
        code,
        humaneval,
        proposer_checker,
        relay,
        shapes,
        gui,
    )
}


def get_task(name: str) -> TaskSpec:
    """The task called `name`; an unknown name raises ValueError listing the valid ones."""
    if name in TASKS:
        return TASKS[name]
    nearest = difflib.get_close_matches(str(name), list(TASKS), n=1)
    hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
    raise ValueError(f"unknown task {name!r}: valid tasks are {sorted(TASKS)}{hint}")
