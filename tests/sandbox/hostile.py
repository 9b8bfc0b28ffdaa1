"""Hostile programs against the sandbox at every isolation level this machine has: shared helpers.

Each test file runs its attacks at each level (the `level` fixture of conftest.py) with the Python
guard off unless it says otherwise: what is tested is the OS boundary and the judge, not the
in-process hook (which a determined program gets past). Rewards are scored the way a run scores
them (`weir.rollout.rewards.score`), so "not FAILED" means the sample would be trained on with
reward 0, not counted as a reward failure. Where docs/code.md says a level does not protect
something, the test asserts that documented behaviour.
"""

from __future__ import annotations

import asyncio

from weir.data.sample import Sample, Status
from weir.rollout.rewards import get_reward, score
from weir.sandbox import LEVELS, Limits, Sandbox, detect


def _works(level: str) -> bool:
    try:
        detect(level)
    except ValueError:
        return False
    return True


LEVELS_HERE = [level for level in LEVELS if _works(level)]
ROOT_UIDS = detect("auto").per_slot_uid  # weir is root: each execution has a uid of its own
LIMITS = Limits(
    wall_s=8, cpu_s=4, memory_mb=256, processes=8, output_bytes=1 << 16, file_bytes=1 << 20
)


def judge_protected(level: str) -> bool:
    """Whether the program cannot reach the judge's process (docs/code.md: only `rlimit` without
    root leaves them under one uid, where the program could read the judge's memory)."""
    return level != "rlimit" or ROOT_UIDS


def scored(sandbox: Sandbox, response: str, row: dict, reward: str = "code_tests") -> Sample:
    """The sample after the reward `reward` scored `response` on `row` as a run would."""
    sample = Sample(prompt_ids=[1], response_text=response)
    asyncio.run(score(get_reward(reward, sandbox=sandbox), sample, row, timeout_s=120))
    return sample


def assert_zero_not_failed(sample: Sample) -> None:
    assert sample.status == Status.COMPLETED, sample.error
    assert sample.reward == 0.0, sample.reward_info
    assert sample.reward_info["exec_status"] != "sandbox_error", sample.reward_info
