"""gymnasium: any environment as weir's env, text both ways; FrozenLake trains for a few steps."""

from __future__ import annotations

from pathlib import Path

import pytest

import weir
from weir.config.adapter_sections import GymnasiumConfig

gym = pytest.importorskip("gymnasium")

from weir.adapters.gymnasium import GymTextEnv, ansi_text, env_factory  # noqa: E402

CONFIG = str(Path(__file__).parents[2] / "examples" / "gymnasium_frozenlake.yaml")
LAKE = GymnasiumConfig(id="FrozenLake-v1", kwargs={"is_slippery": False})


def test_frozenlake_speaks_text_both_ways():
    env = GymTextEnv(LAKE)
    first = env.reset({"env_seed": 0})
    assert first.splitlines()[:4] == ["[S]FFF", "FHFH", "FFFH", "HFFG"]
    assert first.endswith("actions: left, down, right, up")
    assert env.parse_action("I go RIGHT now") == 2 and env.parse_action("3") == 3
    assert env.parse_action("nowhere") is None and env.parse_action("7") is None
    step = env.step("right")  # S -> F: not done, no reward, the marker moved
    assert (step.reward, step.done) == (0.0, False) and step.observation.startswith(
        "  (Right)\nS[F]FF"
    )
    bad = env.step("fly")
    assert bad.info == {"invalid_actions": 1} and bad.observation.startswith(
        "that is not a valid action"
    )
    for move in ["right", "down", "down", "down"]:  # (0,1) -> (0,2) -> ... -> the goal (3,3)
        step = env.step(move)
    step = env.step("right")
    assert (step.reward, step.done, step.observation) == (1.0, True, None)
    assert ansi_text("a\x1b[41mX\x1b[0mb\x1b[1m") == "a[X]b"


def test_a_bad_section_is_refused_at_start_in_one_line():
    with pytest.raises(ValueError, match="gymnasium.id='NoSuchEnv-v9'"):
        env_factory(GymnasiumConfig(id="NoSuchEnv-v9"))
    with pytest.raises(ValueError, match="needs gymnasium.id"):
        env_factory(GymnasiumConfig())


@pytest.mark.slow
def test_frozenlake_trains_for_three_steps(tmp_path):
    result = weir.run(
        CONFIG,
        [f"run.dir={tmp_path}", "run.steps=3", "run.eval_every=0", "rollout.batch_prompts=2"],
    )
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 3
    for h in steps:
        assert h["rollout/failed"] == 0 and h["agent/turns_mean"] >= 1
        assert h["mismatch/abs_logp_diff"] < 1e-4
    # the random policy mostly names no action: counted, and the episode goes on
    assert sum(h["agent/invalid_actions"] for h in steps) > 0
    assert any(h["agent/turns_mean"] > 1 for h in steps)
