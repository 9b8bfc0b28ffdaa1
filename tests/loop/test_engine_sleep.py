"""While the trainer trains, a colocated engine holds no KV cache (and, when asked and the weights are
its own copy, no weights); it decodes again afterwards."""

from __future__ import annotations

import pytest

import weir
import weir.loop.components as components
from weir.train.actor import Actor

SMALL = {
    "run": {"steps": 2, "eval_every": 0, "save_model": False, "seed": 3},
    "model": {"path": "tiny:nano", "threads": 1},
    "data": {"task": "arithmetic", "eval_size": 4},
    "rollout": {"n": 2, "batch_prompts": 4, "max_new_tokens": 4},
    "telemetry": {"console": False},
}


@pytest.mark.parametrize(
    ("loop", "engine", "asleep", "offloaded"),
    [
        ({"mode": "sync"}, {}, True, False),  # shared module: never offloaded
        ({"mode": "sync"}, {"sleep_offload_weights": True, "share_weights": False}, True, True),
        ({"mode": "async", "placement": "colocated"}, {"sleep_offload_weights": True}, True, True),
        ({"mode": "async", "placement": "disaggregated"}, {}, False, False),
        ({"mode": "sync"}, {"sleep_while_training": False}, False, False),
    ],
    ids=["sync", "sync-own-copy-offload", "async-colocated", "async-disaggregated", "off"],
)
def test_engine_sleeps_while_the_trainer_trains(
    tmp_path, monkeypatch, loop, engine, asleep, offloaded
):
    engines, seen = [], []
    make = components.make_engine
    monkeypatch.setattr(
        components, "make_engine", lambda *a, **k: engines.append(make(*a, **k)) or engines[-1]
    )
    train = Actor.train

    def recording_train(self, batch, **kwargs):
        eng = engines[0]
        params = list(eng.model.parameters())
        seen.append(
            (
                eng.kv_stats(),
                all(p.untyped_storage().nbytes() == 0 for p in params),
                any(p.untyped_storage().nbytes() == 0 for p in self.model.parameters()),
            )
        )
        return train(self, batch, **kwargs)

    monkeypatch.setattr(Actor, "train", recording_train)
    cfg = {**SMALL, "loop": loop, "engine": engine}
    result = weir.run(cfg, [f"run.dir={tmp_path}"])
    assert len([h for h in result.history if "reward/mean" in h]) == 2
    assert len(seen) == 2
    for stats, engine_weights_gone, trainer_weights_gone in seen:
        assert stats["asleep"] == float(asleep)
        if asleep:
            assert stats["kv_bytes"] == 0
        assert engine_weights_gone == offloaded
        assert not trainer_weights_gone
    assert engines[0].kv_stats()["asleep"] == 0.0  # awake again after training
    if offloaded:  # the sync loop pushes new weights right after the wake: none copied back
        restored = engines[0].stats()["wake_restored_bytes"]
        assert (restored == 0) == (loop["mode"] == "sync"), restored


def test_a_kv_budget_too_small_for_the_runs_requests_is_refused_at_start(tmp_path):
    # tiny:nano in float32; max_prompt_tokens 512 alone needs more than 1 KiB.
    cfg = {**SMALL, "engine": {"kv_budget_gb": 2**-20}}
    with pytest.raises(ValueError, match=r"n=2 .*raise engine.kv_budget_gb"):
        weir.run(cfg, [f"run.dir={tmp_path}"])


def test_a_kv_budget_that_binds_still_trains(tmp_path, monkeypatch):
    # tiny:nano in float32 is 512 bytes per token; a 32-token prompt with n=4 and 4 new tokens
    # needs 32 + 4 * 35 * (1 + 1/4) = 207 tokens' worth, the most any request of this run can need.
    budget = 1.05 * 207 * 512
    engines = []
    make = components.make_engine
    monkeypatch.setattr(
        components, "make_engine", lambda *a, **k: engines.append(make(*a, **k)) or engines[-1]
    )
    cfg = {
        **SMALL,
        "data": {**SMALL["data"], "max_prompt_tokens": 32},
        "rollout": {**SMALL["rollout"], "n": 4, "batch_prompts": 8},
    }
    weir.run(cfg, [f"run.dir={tmp_path / 'free'}"])
    assert engines[0].kv_stats()["kv_peak_bytes"] > budget  # without it, more is alive at once
    engines.clear()
    result = weir.run({**cfg, "engine": {"kv_budget_gb": budget / 2**30}}, [f"run.dir={tmp_path}"])
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 2
    assert all(h["rollout/failed_frac"] == 0.0 for h in steps)
    assert 0 < engines[0].kv_stats()["kv_peak_bytes"] <= budget
