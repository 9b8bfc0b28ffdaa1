"""`engine.process=true`: the training loop with the built-in engine in a child process."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import weir
from weir.config import load_config

SMALL = {
    "run": {"steps": 3, "eval_every": 0, "save_model": False, "seed": 5},
    "model": {"path": "tiny:nano", "threads": 1},
    "data": {"task": "arithmetic", "eval_size": 4},
    "rollout": {"n": 4, "batch_prompts": 4, "max_new_tokens": 8},
    "telemetry": {"console": False},
}
# what depends on the samples and the weights, not on timing or on where the engine runs
SAME = ("reward/", "train/", "response/", "mismatch/", "adv/", "eval/")


def odd_tokens(sample, row) -> float:
    """A reward the untrained model earns about half the time, so that every step updates."""
    return sum(t % 2 for t in sample.response_ids) / max(1, len(sample.response_ids))


def _numbers(history: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in h.items() if k.startswith(SAME) and "time" not in k}
        for h in history
        if "reward/mean" in h
    ]


def test_a_sync_run_is_the_same_with_the_engine_in_a_process(tmp_path):
    runs = {
        where: weir.run(
            {**SMALL, "engine": {"process": where == "process"}},
            [f"run.dir={tmp_path / where}"],
            reward=odd_tokens,
        )
        for where in ("thread", "process")
    }
    thread, process = (_numbers(runs[w].history) for w in ("thread", "process"))
    assert len(thread) == 3 and thread[0].keys() == process[0].keys()
    assert {"reward/mean", "mismatch/abs_logp_diff"} <= thread[0].keys()
    assert all(h["train/loss"] != 0.0 for h in thread)  # the weights change every step
    for t, p in zip(thread, process, strict=True):
        assert {k: (t[k], p[k]) for k in t if t[k] != p[k]} == {}


def test_an_async_run_with_the_engine_in_a_process(tmp_path):
    cfg = {
        **SMALL,
        "run": {**SMALL["run"], "steps": 4},
        "rollout": {**SMALL["rollout"], "max_new_tokens": 24},
        "loop": {"mode": "async", "max_staleness": 1},
        "engine": {"process": True},
    }
    result = weir.run(cfg, [f"run.dir={tmp_path}"])
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 4
    assert max(h["staleness/max"] for h in steps) <= 1
    # the policy the engine samples from follows the trainer: the trainer's log-probs of the
    # sampled tokens stay within one update's drift of the engine's
    assert all(h["mismatch/abs_logp_diff"] < 0.5 for h in steps)
    assert all(h["engine/idle_frac"] < 1.0 for h in steps[1:])  # the child's counters arrive


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["engine.type=vllm"], "a vllm server already runs in its own process"),
        (["cluster.type=ray"], r"every engine replica is a process \(a Ray actor\) of its own"),
    ],
)
def test_engine_process_is_refused_where_the_engine_is_a_process_already(overrides, names):
    with pytest.raises((ValidationError, ValueError), match=names):
        load_config(None, ["engine.process=true", *overrides])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_with_two_engine_processes(mode, tmp_path):
    """engine.replicas=2: both processes serve every step, and every weight update reaches both
    (the engine's log-probs stay the trainer's, which a replica left on old weights would not)."""
    cfg = {
        **SMALL,
        "run": {**SMALL["run"], "steps": 4},
        "rollout": {**SMALL["rollout"], "max_new_tokens": 16},
        "train": {"lr": 5e-3},
        "loop": {"mode": mode, "max_staleness": 1, "on_weight_update": "finish"},
        "engine": {"process": True, "replicas": 2},
    }
    result = weir.run(cfg, [f"run.dir={tmp_path}"], reward=odd_tokens)
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 4
    mismatch = [h["mismatch/abs_logp_diff"] for h in steps]
    if mode == "sync":
        assert all(h["train/loss"] != 0.0 for h in steps)  # the weights change every step
        assert max(mismatch) < 1e-5, mismatch  # the same weights, float32: rounding only
    else:  # one update of staleness at most: the drift of one step
        assert max(h["staleness/max"] for h in steps) <= 1
        assert max(mismatch) < 0.5, mismatch
