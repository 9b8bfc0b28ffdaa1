"""A Ray run starts its trainer ranks and its engines side by side (weir.loop.ray_build), unless
the engines size their memory from what the trainer leaves; where either fails, what the other
started is closed and the failure is the one raised."""

from __future__ import annotations

import threading

import pytest

from weir.config import build_config
from weir.loop.ray_build import (
    _start_engines,
    _start_in_turn,
    _start_together,
    starts_side_by_side,
)

WAIT_S = 10.0


class Closable:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def close(self) -> None:
        self.log.append(f"closed {self.name}")

    def shutdown(self) -> None:
        self.log.append(f"shut down {self.name}")


def test_the_trainer_and_the_engines_start_at_the_same_time():
    """Each side waits for the other to have begun: started one after the other, neither would
    finish (the wait would time out)."""
    trainer_began, engines_began = threading.Event(), threading.Event()
    log: list[str] = []

    def trainer():
        trainer_began.set()
        assert engines_began.wait(WAIT_S), "the engines did not start while the trainer did"
        return Closable("trainer", log)

    def engines():
        engines_began.set()
        assert trainer_began.wait(WAIT_S), "the trainer did not start while the engines did"
        return {"": Closable("engine", log)}

    trainer_group, started = _start_together(trainer, engines)
    assert trainer_group.name == "trainer" and started[""].name == "engine"
    assert log == []  # nothing closed


def test_engines_that_fail_leave_no_trainer_behind():
    log: list[str] = []

    def engines():
        raise ValueError("engine.type=vllm: no server")

    with pytest.raises(ValueError, match="no server"):
        _start_together(lambda: Closable("trainer", log), engines)
    assert log == ["shut down trainer"]


def test_a_trainer_that_fails_leaves_no_engines_behind():
    log: list[str] = []

    def trainer():
        raise RuntimeError("trainer rank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        _start_together(trainer, lambda: {"a": Closable("a", log), "b": Closable("b", log)})
    assert sorted(log) == ["closed a", "closed b"]


def test_when_both_fail_the_engines_failure_is_raised_and_nothing_is_left():
    def trainer():
        raise RuntimeError("trainer rank 0 died")

    def engines():
        raise ValueError("engine replica 0 died")

    with pytest.raises(ValueError, match="replica 0"):
        _start_together(trainer, engines)


class Group:
    def __init__(self, role: str, log: list[str], fails: bool = False) -> None:
        self.role, self.log, self.fails = role, log, fails

    def start(self, eos_token_ids: list[int]) -> Closable:
        if self.fails:
            raise ValueError(f"group {self.role} failed")
        return Closable(self.role, self.log)


def test_a_policys_engines_that_fail_close_the_ones_started_before():
    log: list[str] = []
    groups = [Group("a", log), Group("b", log), Group("c", log, fails=True)]
    with pytest.raises(ValueError, match="group c failed"):
        _start_engines(groups, [2])
    assert sorted(log) == ["closed a", "closed b"]
    assert set(_start_engines(groups[:2], [2])) == {"a", "b"}


def _cluster(*overrides: str):
    return build_config({"data": {"task": "arithmetic"}}, ["cluster.type=ray", *overrides])


@pytest.mark.parametrize(
    ("overrides", "side_by_side"),
    [
        ((), True),  # CPU engines on bundles of their own, no budget from free memory
        (("cluster.trainer.gpus_per_rank=1", "cluster.engines.gpus=1"), True),  # own GPUs
        (("engine.kv_budget_gb=2",), True),  # a fixed budget
        (("cluster.colocate=true",), False),  # on the trainer's bundles
        (("cluster.colocate=true", "engine.type=vllm"), False),
        (("engine.kv_budget_fraction=0.5",), False),  # of the node's free RAM
        (("engine.kv_budget_fraction=0.5", "cluster.engines.gpus=1"), True),  # of its own GPU
    ],
)
def test_engines_that_size_their_memory_from_the_trainers_start_after_it(overrides, side_by_side):
    assert starts_side_by_side(_cluster(*overrides)) is side_by_side


def test_in_turn_the_engines_start_once_the_trainer_has():
    log: list[str] = []

    def trainer():
        log.append("trainer")
        return Closable("trainer", log)

    def engines():
        log.append("engines")
        return {"": Closable("engine", log)}

    _start_in_turn(trainer, engines)
    assert log == ["trainer", "engines"]

    def failing():
        raise ValueError("engine replica 0 died")

    with pytest.raises(ValueError, match="replica 0"):
        _start_in_turn(trainer, failing)
    assert log[-1] == "shut down trainer"
