"""Asynchronous training: eta = 0 reproduces the synchronous batches; async learns; staleness is bounded."""

from __future__ import annotations

from collections import defaultdict

import pytest

import weir
from weir.config import load_config
from weir.rollout.single_turn import rollout as default_rollout

SMALL = {
    "run": {"steps": 3, "eval_every": 0, "save_model": False, "seed": 3},
    "model": {"path": "tiny:nano", "threads": 1},
    "data": {"task": "arithmetic", "eval_size": 4},
    "rollout": {"n": 2, "batch_prompts": 4, "max_new_tokens": 4},
    "telemetry": {"console": False},
}


def _recording_rollout(log: dict):
    async def fn(ctx, row):
        log[ctx.engine.version].append(row["_index"])  # the weight version current at admission
        return await default_rollout(ctx, row)

    return fn


def test_eta_zero_trains_the_same_batches_as_sync(tmp_path):
    seen = {}
    for mode in ("sync", "async"):
        log: dict[int, list[int]] = defaultdict(list)
        cfg = {**SMALL, "loop": {"mode": mode, "max_staleness": 0}}
        result = weir.run(cfg, [f"run.dir={tmp_path / mode}"], rollout=_recording_rollout(log))
        assert len([h for h in result.history if "reward/mean" in h]) == 3
        # eval rows (4 per evaluation) are rolled out at versions 0 and 3; keep training prompts
        seen[mode] = {v: sorted(ix) for v, ix in log.items() if v < 3}
        for h in result.history[1:]:
            assert h["staleness/max"] == 0.0
    assert seen["sync"].keys() == seen["async"].keys() == {0, 1, 2}
    for v in range(3):
        assert seen["sync"][v] == seen["async"][v], v


@pytest.mark.parametrize("eta", [1, 2])
def test_async_staleness_never_exceeds_eta(tmp_path, eta):
    cfg = {
        **SMALL,
        "run": {**SMALL["run"], "steps": 5},
        "loop": {"mode": "async", "max_staleness": eta},
    }
    result = weir.run(cfg, [f"run.dir={tmp_path}"])
    steps = [h for h in result.history if "staleness/max" in h]
    assert len(steps) == 5
    assert max(h["staleness/max"] for h in steps) <= eta


@pytest.mark.slow
def test_async_learns_the_easy_task(tmp_path):
    from test_learning import EASY

    sft_model = weir.sft(EASY, [f"run.dir={tmp_path / 'sft'}"])
    overrides = [
        "loop.mode=async",
        "loop.max_staleness=1",
        f"model.path={sft_model}",
        "run.steps=20",
    ]
    result = weir.run(EASY, [f"run.dir={tmp_path / 'rl'}", *overrides])
    rewards = [h["reward/mean"] for h in result.history if "reward/mean" in h]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert result.evals[-1]["eval/accuracy"] > result.evals[0]["eval/accuracy"] + 0.2
    assert max(h["staleness/max"] for h in result.history if "staleness/max" in h) <= 1


@pytest.mark.parametrize(
    "loop",
    [
        {"on_weight_update": "abort"},
        {"on_weight_update": "mask_stale"},
        {"placement": "colocated"},
    ],
    ids=["abort", "mask_stale", "colocated"],
)
def test_async_weight_update_policies_and_placement_run(tmp_path, loop):
    cfg = {
        **SMALL,
        "run": {**SMALL["run"], "steps": 4},
        "rollout": {**SMALL["rollout"], "n": 4, "max_new_tokens": 12},
        "loop": {"mode": "async", "max_staleness": 2, **loop},
    }
    result = weir.run(cfg, [f"run.dir={tmp_path}"])
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 4
    assert all(0.0 <= h["engine/idle_frac"] <= 1.0 for h in steps)
    assert all(
        sum(v for k, v in h.items() if k.startswith("staleness/hist_")) == pytest.approx(1.0)
        for h in steps
    )


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_kv_on_update_rebuilds_or_keeps_the_kv_of_responses_in_flight(tmp_path, kv):
    """Responses of 48 tokens from two batches in flight: every weight update meets some of them.
    `recompute` prefills their context again under the new weights; `keep` does not."""
    cfg = {
        **SMALL,
        "run": {**SMALL["run"], "steps": 4},
        "rollout": {**SMALL["rollout"], "max_new_tokens": 48},
        "loop": {"mode": "async", "max_staleness": 1},
        "engine": {"kv_on_update": kv},
    }
    result = weir.run(cfg, [f"run.dir={tmp_path}"])
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 4
    recomputed = sum(h["engine/recomputed_tokens"] for h in steps)
    if kv == "recompute":
        assert recomputed > 0
    else:
        assert recomputed == 0


def _version_sets(log: list):
    async def fn(ctx, row):
        group = await default_rollout(ctx, row)
        log.extend(frozenset(s.versions) for s in group.samples)
        return group

    return fn


def _four_async_steps(tmp_path, max_new_tokens: int, **loop) -> tuple[list[dict], list[frozenset]]:
    """Four async steps of `max_new_tokens`-token responses under `max_staleness: 1` and `loop`;
    the steps' metrics (checked: four, none more than one version stale) and the version sets of
    every response (`_version_sets`)."""
    log: list[frozenset] = []
    cfg = {
        **SMALL,
        "run": {**SMALL["run"], "steps": 4},
        "rollout": {**SMALL["rollout"], "max_new_tokens": max_new_tokens},
        "loop": {"mode": "async", "max_staleness": 1, **loop},
    }
    result = weir.run(cfg, [f"run.dir={tmp_path}"], rollout=_version_sets(log))
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 4 and max(h["staleness/max"] for h in steps) <= 1
    return steps, log


@pytest.mark.parametrize(
    "policy, placement",
    [("continue", "disaggregated"), ("finish", "disaggregated"), ("finish", "colocated")],
)
def test_finish_samples_every_response_under_one_version(tmp_path, policy, placement):
    """48-token responses, the next batch generating while the trainer trains: with `continue` some
    response spans a weight update; with `finish` every one is one version's, the update waiting
    for it (time/drain) and no KV rebuilt."""
    steps, log = _four_async_steps(tmp_path, 48, on_weight_update=policy, placement=placement)
    spans = max(len(v) for v in log)
    if policy == "continue":
        assert spans == 2
    else:
        assert spans == 1 and len({v for vs in log for v in vs}) >= 3
        assert all(h["engine/recomputed_tokens"] == 0 for h in steps)
        assert sum(h["time/drain"] for h in steps) > 0


def test_finish_gives_up_waiting_after_finish_timeout_s(tmp_path):
    """With a wait far shorter than a response, the update stops waiting: the run goes on, the
    timeouts are counted, and the responses caught in flight span two versions, as with
    `continue`."""
    steps, log = _four_async_steps(tmp_path, 96, on_weight_update="finish", finish_timeout_s=0.001)
    assert sum(h["async/drain_timeouts"] for h in steps) >= 1
    assert max(len(v) for v in log) == 2


def test_a_colocated_hold_that_times_out_pauses_and_the_swap_does_not_drain_again(monkeypatch):
    """Colocated, `finish` with a timeout: the trainer must not train beside a decoding engine, so
    a drain that gave up pauses the engine; the push that follows the training neither drains a
    paused engine (refused) nor leaves it held."""
    from weir.loop import async_loop

    class Engine:
        def __init__(self, done: bool) -> None:
            self.done, self.calls = done, []

        def drain_sync(self, timeout):
            self.calls.append(("drain", timeout))
            return self.done

        def pause_sync(self):
            self.calls.append(("pause",))

        def resume_sync(self):
            self.calls.append(("resume",))

    monkeypatch.setattr(async_loop, "push_weights", lambda parts, v: {"sync/version": float(v)})
    for done in (False, True):
        engine = Engine(done)
        held = async_loop.hold_engine(engine, "finish", 0.5)
        assert held["async/drain_timeouts"] == float(not done)
        parts = type("Parts", (), {"engine": engine})()
        pushed = async_loop.swap_weights(parts, 3, "finish", 0.5, held=True)
        assert pushed == {"sync/version": 3.0}
        paused = [("pause",)] if not done else []
        assert engine.calls == [("drain", 0.5), *paused, ("resume",)]


def test_kv_on_update_keep_is_refused_for_server_engines():
    with pytest.raises(ValueError, match="engine.kv_on_update=recompute"):
        load_config(None, ["engine.type=vllm", "engine.kv_on_update=keep"])


def test_mask_stale_prefix_trains_only_the_newest_version():
    from weir.data.sample import Group, Sample
    from weir.train.batch import mask_stale_prefix

    interrupted = Sample(
        prompt_ids=[1], response_ids=[5, 6, 7, 8], loss_mask=[1, 1, 0, 1], versions=[3, 3, -1, 4]
    )
    whole = Sample(prompt_ids=[1], response_ids=[5, 6], versions=[4, 4])
    assert mask_stale_prefix([Group(samples=[interrupted, whole])]) == 2
    assert interrupted.loss_mask == [0, 0, 0, 1]
    assert whole.loss_mask == [1, 1]


def test_async_filter_oversamples_until_batches_are_full(tmp_path):
    dropped = []

    def keep_even(group):
        ok = group.row["_index"] % 2 == 0
        if not ok:
            dropped.append(group.row["_index"])
        return ok

    cfg = {**SMALL, "loop": {"mode": "async", "max_staleness": 1}}
    result = weir.run(cfg, [f"run.dir={tmp_path}"], filter=keep_even)
    steps = [h for h in result.history if "batch/samples" in h]
    assert len(steps) == 3
    assert all(h["batch/samples"] == 4 * 2 for h in steps)  # every batch holds 4 groups that passed
    assert sum(h["rollout/filtered_groups"] for h in steps) <= len(dropped)
    assert dropped  # odd rows were drawn and filtered, and more prompts were admitted instead


def test_a_raising_filter_stops_async_with_its_message_instead_of_hanging(tmp_path):
    from weir.loop.run import RunError

    def broken(group):
        raise KeyError("no such field")

    cfg = {**SMALL, "loop": {"mode": "async", "max_staleness": 1}}
    with pytest.raises(RunError, match="rollout.filter raised KeyError"):
        weir.run(cfg, [f"run.dir={tmp_path}"], filter=broken)
