"""The shapes demo in CI size: SFT on colour questions teaches the tiny Qwen2.5-VL to read the
colour off the pixels (the text of every prompt is the same, so only the image can tell), and GRPO
then trains on image prompts with engine and trainer in agreement."""

from __future__ import annotations

import pytest

from weir.loop.demo import run_demo


@pytest.mark.slow
def test_shapes_demo_reads_colours_from_pixels(tmp_path):
    summary = run_demo(
        "shapes",
        tmp_path / "demo",
        [
            "model.path=tiny-vlm:nano",
            "data.task_options={questions: colour}",
            "sft.task_options={corrupt: 0.0, questions: colour}",
            "sft.rows=640",
            "sft.epochs=2",
            "sft.lr=3e-3",
            "data.eval_size=40",
            "run.steps=2",
            "run.eval_every=0",
            "rollout.batch_prompts=4",
            "rollout.n=4",
            "telemetry.console=false",
        ],
    )
    # four colours: chance is 25%; the same question text for every image
    assert summary["accuracy_after_sft"] >= 0.45  # P(>= 18 of 40 | chance) < 0.005
    metrics = (tmp_path / "demo" / "rl" / "metrics.jsonl").read_text()
    assert metrics.count('"reward/mean"') == 2
