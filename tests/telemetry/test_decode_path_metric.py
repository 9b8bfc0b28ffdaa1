"""Each training step says which decode path the engine runs, so a run that lost weir's direct
forward (and with it the CUDA graphs) shows it in metrics.jsonl, not only in a log line."""

from __future__ import annotations

import json

from short_runs import SHORT, spread_reward

import weir
from weir.engine.decode import DecodeForward


def train_steps(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "train/grad_norm" in m]


def test_both_loops_report_the_direct_decode_path_on_every_step(sync_run, async_run):
    for result in (sync_run, async_run):
        steps = train_steps(result.dir)
        assert len(steps) == 3
        # the tiny model is a Qwen3 / Llama: the direct forward passes its check; no CUDA graphs
        assert [s["engine/decode_direct"] for s in steps] == [1.0, 1.0, 1.0]
        assert [s["engine/decode_graphs"] for s in steps] == [0.0, 0.0, 0.0]


def test_a_refused_direct_forward_shows_as_zero_from_the_first_step(tmp_path, monkeypatch):
    real = DecodeForward.__call__
    monkeypatch.setattr(DecodeForward, "__call__", lambda self, *a, **k: real(self, *a, **k) + 1e-6)
    result = weir.run(SHORT, [f"run.dir={tmp_path}"], reward=spread_reward)
    assert [s["engine/decode_direct"] for s in train_steps(result.dir)] == [0.0, 0.0, 0.0]
