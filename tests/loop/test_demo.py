"""`weir demo` end to end at toy size: SFT, RL, the before/after summary and the run's report."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from weir.loop.demo import run_demo


def test_demo_writes_its_summary_and_report(tmp_path, capfd):
    console = Console(record=True, width=200)
    overrides = ["sft.rows=300", "sft.epochs=1", "run.steps=3", "data.eval_size=20"]
    summary = run_demo("arithmetic", tmp_path, overrides, console=console)
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert saved == summary and summary["rl_steps"] == 3 and summary["eval_prompts"] == 20
    assert 0.0 <= summary["accuracy_after_rl_last3_mean"] <= 1.0
    report = tmp_path / "rl" / "report" / "report.html"
    assert report.exists() and str(report) in console.export_text()
    assert list((tmp_path / "rl" / "rollouts").glob("step_*.jsonl"))  # samples for the report
    # a second demo into the same directory starts fresh instead of resuming the first
    capfd.readouterr()
    again = run_demo("arithmetic", tmp_path, overrides, console=Console(record=True))
    assert again["rl_steps"] == 3
    steps = [json.loads(line)["step"] for line in (tmp_path / "rl" / "metrics.jsonl").open()]
    assert steps == [0, 1, 2, 3]
    assert "resumed" not in capfd.readouterr().err


def test_demo_summarises_the_eval_breakdown_after_sft_and_after_rl():
    from weir.loop.demo import breakdown_summary, role_summary

    evals = [
        {"eval/accuracy": 0.1, "eval/question/colour/accuracy": 0.0, "eval/q/count/accuracy": 0.2},
        *({"eval/question/colour/accuracy": a} for a in (0.5, 0.6, 0.8, 1.0)),
    ]
    assert breakdown_summary(evals) == {
        "by/question=colour/accuracy_after_sft": 0.0,
        "by/question=colour/accuracy_after_rl_last3_mean": pytest.approx(0.8),
        "by/q=count/accuracy_after_sft": 0.2,
        "by/q=count/accuracy_after_rl_last3_mean": 0.2,
    }
    assert role_summary(evals) == {}  # a breakdown is not a role
