"""A real pretrained model learns in CI: SmolLM2-135M-Instruct (PyPI's Q4_1 GGUF, the `smollm2_dir`
fixture) on two-digit additions asked in words, rewarded by the number it gives (`numeric`): GRPO
raises its greedy held-out accuracy on the same held-out problems before and after by a stated
margin. The run is examples/smollm2_arithmetic.yaml (the real-model demo) made smaller."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import weir

CONFIG = str(Path(__file__).parents[2] / "examples" / "smollm2_arithmetic.yaml")
STEPS = 6
MARGIN = 0.2


@pytest.mark.slow
def test_grpo_raises_a_real_models_held_out_accuracy(smollm2_dir, tmp_path):
    result = weir.run(
        CONFIG,
        [
            f"run.dir={tmp_path / 'rl'}",
            f"model.path={smollm2_dir}",
            f"run.steps={STEPS}",
            "run.eval_every=0",  # before and after only
            "model.threads=1",  # one core: the other test worker has the other
            "rollout.batch_prompts=8",
            "data.eval_size=100",
            "train.lr=2e-5",
        ],
    )
    before, after = result.evals[0]["eval/accuracy"], result.evals[-1]["eval/accuracy"]
    # 100 held-out problems: a binomial standard error of 5 points at most, so a rise of 20
    # points is 3 standard errors of the difference
    assert after >= before + MARGIN, (before, after)
    lines = [json.loads(x) for x in (result.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(STEPS + 1))
    assert all(r["mismatch/abs_logp_diff"] < 1e-4 for r in lines[1:])  # on-policy in float32
