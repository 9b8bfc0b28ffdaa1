"""multi_agent.policies=separate, the engine side: each role's turns go to its own engine; weights
reach each role's engine under one version; the multi-agent rollout asks for the acting role's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.rollout.test_multi_agent import RoleEngine, ctx_for, roles
from weir.engine.base import Completion, SamplingParams
from weir.engine.role_router import RoleRouter, split_weights
from weir.rollout.multi_agent import rollout
from weir.train.role_trainer import RoleTrainer


class FakeEngine:
    """Records what reaches it; answers with its own token id."""

    def __init__(self, token: int) -> None:
        self.token, self.version = token, 0
        self.prompts: list[list[int]] = []
        self.weights: list[tuple[str, torch.Tensor]] = []
        self.events: list[str] = []
        self.rng = token

    async def generate(self, prompt_ids, params) -> list[Completion]:
        self.prompts.append(list(prompt_ids))
        return [Completion([self.token], [-0.5], [self.version], "stop")]

    async def update_weights(self, named, version) -> None:
        self.weights = list(named)
        self.version = version

    def stats(self) -> dict[str, float]:
        return {"busy_s": float(self.token), "generated_tokens": 10.0 * self.token}

    def state_dict(self):
        return {"rng": self.rng, "version": self.version}

    def load_state_dict(self, state) -> None:
        self.rng, self.version = state["rng"], state["version"]

    def drain_sync(self, timeout=None) -> bool:
        self.events.append("drain_sync")
        self.drain_timeouts = [*getattr(self, "drain_timeouts", []), timeout]
        return getattr(self, "drained", True)

    def __getattr__(self, name: str):
        if name.endswith("_sync") or name == "close":
            return lambda **kw: self.events.append(name + (f"{kw}" if kw else ""))
        raise AttributeError(name)


def test_requests_go_to_their_roles_engine_and_a_roleless_one_is_refused():
    a, b = FakeEngine(7), FakeEngine(8)
    router = RoleRouter({"a": a, "b": b})
    params = SamplingParams(max_new_tokens=2)
    (c,) = asyncio.run(router.generate([1, 2], params, role="b"))
    assert c.token_ids == [8] and b.prompts == [[1, 2]] and not a.prompts
    assert router.for_role("a") is a
    with pytest.raises(ValueError, match="must\\s+name its role"):
        asyncio.run(router.generate([1], params))
    with pytest.raises(KeyError, match="no engine for role 'c'"):
        router.for_role("c")


def test_the_multi_agent_rollout_generates_each_turn_with_its_roles_engine():
    engines = {
        "a": RoleEngine({"a": ["12", "3"], "b": ["x"]}),
        "b": RoleEngine({"a": ["9"], "b": ["no"]}),
    }
    router = RoleRouter(engines)
    group = asyncio.run(
        rollout(
            ctx_for(router, roles("a", "b", turns=["a", "b", "a"]), n=2),
            {"prompt": "3+4", "answer": "7"},
        )
    )
    # a's engine served only a's turns (2 episodes x 2 turns), b's only b's (2 x 1)
    assert [r for r, _ in engines["a"].prompts] == ["a"] * 4
    assert [r for r, _ in engines["b"].prompts] == ["b"] * 2
    texts = {(s.metadata["role"], s.response_text) for s in group.samples}
    assert texts == {("a", "3"), ("b", "no")}


def test_weights_reach_each_roles_engine_under_one_version():
    a, b = FakeEngine(1), FakeEngine(2)
    router = RoleRouter({"a": a, "b": b})

    class Actor:  # what RoleTrainer reads from an actor
        def __init__(self, value: float) -> None:
            self.w = torch.full((2,), value)

        def weights(self):
            return [("w", self.w), ("v", self.w + 1)]

    trainer = RoleTrainer({"a": Actor(1.0), "b": Actor(2.0)})
    asyncio.run(router.update_weights(trainer.weights(), 5))
    assert [n for n, _ in a.weights] == ["w", "v"] and a.weights[0][1] is trainer.actors["a"].w
    assert b.weights[0][1] is trainer.actors["b"].w
    assert a.version == b.version == router.version == 5
    b.version = 4  # an update half done: admission must see the older version
    assert router.version == 4
    with pytest.raises(ValueError, match=r"no weights for role\(s\) \['b'\]"):
        asyncio.run(router.update_weights([("a/w", torch.zeros(2))], 6))
    with pytest.raises(KeyError, match="names no role"):
        split_weights([("w", torch.zeros(1))], ["a", "b"])


def test_drain_shares_one_timeout_across_the_roles_and_reports_any_left_running():
    a, b = FakeEngine(1), FakeEngine(3)
    router = RoleRouter({"a": a, "b": b})
    assert router.drain_sync() is True and a.drain_timeouts == b.drain_timeouts == [None]
    b.drained = False
    assert router.drain_sync(timeout=5.0) is False
    assert 0 <= b.drain_timeouts[-1] <= a.drain_timeouts[-1] <= 5.0


def test_pause_abort_drain_sleep_close_reach_every_engine_and_stats_add_up():
    a, b = FakeEngine(1), FakeEngine(3)
    router = RoleRouter({"a": a, "b": b}, sleep_while_training=True, offload_weights={"b": True})
    router.pause_sync()
    router.abort_sync()
    router.drain_sync()
    router.resume_sync()
    with router.asleep():
        assert a.events[-1] == "sleep_sync{'offload_weights': False}"
        assert b.events[-1] == "sleep_sync{'offload_weights': True}"
    router.close()
    for e in (a, b):
        assert [x.split("{")[0] for x in e.events] == [
            "pause_sync",
            "abort_sync",
            "drain_sync",
            "resume_sync",
            "sleep_sync",
            "wake_sync",
            "close",
        ]
    assert b.events[-2] == "wake_sync{'update_follows': False}"
    with router.asleep(update_follows=True):  # the sync loop: new weights follow the wake
        pass
    assert b.events[-1] == "wake_sync{'update_follows': True}"
    quiet = RoleRouter({"a": FakeEngine(1)})
    with quiet.asleep():  # engine.sleep_while_training off: nothing sleeps
        pass
    assert quiet.engines["a"].events == []
    stats = router.stats()
    assert stats["busy_s"] == 2.0  # the mean: engine/idle_frac is the engines' mean idle share
    assert stats["generated_tokens"] == 40.0 and stats["b/generated_tokens"] == 30.0


def test_engine_state_round_trips_per_role():
    router = RoleRouter({"a": FakeEngine(1), "b": FakeEngine(2)})
    state = router.state_dict()
    other = RoleRouter({"a": FakeEngine(5), "b": FakeEngine(6)})
    other.load_state_dict(state)
    assert other.engines["a"].rng == 1 and other.engines["b"].rng == 2
    with pytest.raises(ValueError, match="was multi_agent.roles changed"):
        other.load_state_dict({"a": state["a"]})
