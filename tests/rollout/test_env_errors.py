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


def test_one_episodes_sync_env_calls_share_one_thread_and_a_hang_fails_only_it():
    """reset, step and close of one environment run on one thread (so thread-bound resources,
    such as an sqlite connection, work), not the event loop's; a hung one fails its episode
    within agent.env_timeout_s while another episode completes."""
    import asyncio
    import threading

    from test_multi_turn import ROW, ScriptedEngine, make_ctx

    from weir.config.schema import AgentConfig
    from weir.data.sample import Status
    from weir.rollout.multi_turn import run_episode

    class Recorder:
        def __init__(self, hang=False):
            self.threads, self.hang = [], hang

        def reset(self, row):
            self.threads.append(threading.get_ident())
            return "go"

        def step(self, action):
            self.threads.append(threading.get_ident())
            if self.hang:
                time.sleep(2)
            return None, 1.0, True, {}

        def close(self):
            self.threads.append(threading.get_ident())

    agent = AgentConfig(reward="env", env_timeout_s=0.5)
    ok, stuck = Recorder(), Recorder(hang=True)

    async def both():
        return await asyncio.gather(
            run_episode(make_ctx(ScriptedEngine(["a"]), agent), ROW, ok, agent),
            run_episode(make_ctx(ScriptedEngine(["a"]), agent), ROW, stuck, agent),
        )

    start = time.monotonic()
    good, bad = asyncio.run(both())
    assert time.monotonic() - start < 1.8  # the hung step did not hold up the run
    assert good.status == Status.COMPLETED and good.reward == 1.0
    assert len(ok.threads) == 3 and len(set(ok.threads)) == 1
    assert ok.threads[0] != threading.get_ident()
    assert bad.status == Status.FAILED and "env_timeout_s" in bad.error
    assert bad.metadata["metrics"]["agent/env_timeouts"] == 1.0
