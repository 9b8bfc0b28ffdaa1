"""The run's trace.json is Chrome trace JSON with spans for every phase of the step."""

from __future__ import annotations

import json

import pytest

import weir

SMALL = {
    "run": {"steps": 2, "eval_every": 0, "save_model": False},
    "model": {"path": "tiny:nano", "threads": 1},
    "data": {"task": "arithmetic", "eval_size": 4},
    "rollout": {"n": 2, "batch_prompts": 3, "max_new_tokens": 3},
    "telemetry": {"console": False},
}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_trace_has_a_span_for_every_phase(tmp_path, mode):
    # a reference model (its log-probs get a span) and rewards with spread (so rows have gradients)
    result = weir.run(
        {**SMALL, "loop": {"mode": mode}},
        [f"run.dir={tmp_path}", "algo.old_logprobs=recompute", "algo.kl.coef=0.01"],
        reward=lambda sample, row: 1.0 if sample.index == 0 else 0.0,
    )
    trace = json.loads((result.dir / "trace.json").read_text())
    events = trace["traceEvents"]
    complete = {e["name"] for e in events if e["ph"] == "X"}
    expected = {"train", "logprobs", "forward", "backward", "optimizer", "sync", "eval"}
    expected |= {"wait"} if mode == "async" else {"generate"}
    assert expected <= complete, expected - complete
    begins = [e for e in events if e["ph"] == "b"]
    ends = {(e["name"], e["id"]) for e in events if e["ph"] == "e"}
    assert {"generate", "reward"} <= {e["name"] for e in begins}
    assert all((e["name"], e["id"]) in ends for e in begins)  # every async span was closed
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    assert any(e["ph"] == "M" and e["name"] == "thread_name" for e in events)


def test_trace_can_be_switched_off(tmp_path):
    result = weir.run(SMALL, [f"run.dir={tmp_path}", "telemetry.trace=false"])
    assert not (result.dir / "trace.json").exists()


def test_rollout_dumps_hold_exactly_what_was_trained(tmp_path):
    result = weir.run(SMALL, [f"run.dir={tmp_path}", "telemetry.dump_rollouts=true"])
    files = sorted((result.dir / "rollouts").glob("step_*.jsonl"))
    assert [f.name for f in files] == ["step_000001.jsonl", "step_000002.jsonl"]
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert len(records) == 3 * 2  # batch_prompts x n
    for r in records:
        n = len(r["response_ids"])
        assert len(r["rollout_logprobs"]) == len(r["versions"]) == len(r["loss_mask"]) == n
        assert set(r["versions"]) == {0} and all(lp <= 0 for lp in r["rollout_logprobs"])
        assert r["row"]["prompt"] and r["status"] in ("completed", "truncated")
    mean = sum(r["reward"] for r in records) / len(records)
    assert mean == pytest.approx(result.history[1]["reward/mean"])


def test_tensorboard_events_hold_the_step_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = weir.run(SMALL, [f"run.dir={tmp_path}", "telemetry.tensorboard=true"])
    acc = EventAccumulator(str(result.dir / "tensorboard"))
    acc.Reload()
    rewards = acc.Scalars("reward/mean")
    assert [e.step for e in rewards] == [1, 2]
    assert rewards[0].value == pytest.approx(result.history[1]["reward/mean"], abs=1e-6)
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [0, 2]
    assert "train/grad_norm" in acc.Tags()["scalars"]
