"""Environments a user writes fail in every way they can (raise, hang, return the wrong shape):
each failure fails its episode, is counted in the step's metrics, and the run goes on."""

from __future__ import annotations

import time

import pytest

import weir


class Flaky:
    """By the row: raises in reset, hangs in reset, returns a malformed observation from step, or
    plays a normal one-step episode."""

    def reset(self, row):
        self.kind = row["_index"] % 4
        if self.kind == 0:
            raise RuntimeError("the simulator crashed")
        if self.kind == 1:
            time.sleep(3)  # past agent.env_timeout_s: the episode fails, the others go on
        return "say something"

    def step(self, action):
        if self.kind == 2:
            return 42, 0.0, False, {}  # an observation that is not text
        return None, 1.0, True, {}


@pytest.mark.slow
def test_a_failing_environment_is_counted_and_the_run_goes_on(tmp_path):
    result = weir.run(
        {
            "run": {"steps": 2, "eval_every": 0, "save_model": False, "dir": str(tmp_path)},
            "model": {"path": "tiny:nano", "threads": 1},
            "data": {"task": "arithmetic", "task_options": {"digits": 1}, "eval_size": 4},
            "rollout": {
                "function": "weir.rollout.multi_turn:rollout",
                "n": 2,
                "batch_prompts": 8,
                "max_new_tokens": 4,
                "max_failed_fraction": 0.9,
                "filter": None,
            },
            "agent": {
                "env": f"{__name__}:Flaky",
                "reward": "env",
                "max_turns": 2,
                "env_timeout_s": 0.5,
                "play_cut_turns": True,
            },
        }
    )
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 2
    errors = {
        k: sum(h[f"agent/{k}"] for h in steps)
        for k in ("env_errors", "env_timeouts", "env_bad_results")
    }
    assert errors["env_timeouts"] > 0 and errors["env_bad_results"] > 0
    assert errors["env_errors"] > errors["env_timeouts"] + errors["env_bad_results"]  # + crashes
    failed = sum(h["rollout/failed"] for h in steps)
    assert failed == errors["env_errors"]  # each failure fails exactly its own episode
    assert all(h["rollout/failed"] < h["rollout/samples"] for h in steps)
    assert all(h["reward/mean"] == 1.0 for h in steps)  # the healthy episodes scored
