"""Every config in examples/ validates, names a real task and reward, and its task builds data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from weir.config import load_config
from weir.loop.components import reward_function, task_rows
from weir.tasks import get_task

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.yaml"))


def test_there_is_a_config_per_builtin_task():
    from weir.tasks import TASKS

    names = {p.stem for p in EXAMPLES}
    assert set(TASKS) <= names
    assert "gsm8k_qwen" in names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_validates_and_builds_its_data(path, tmp_path):
    overrides = ["data.eval_size=5", "data.train_size=5"]
    if load_config(path).reward.function == "reward_model":  # its RM path is a placeholder
        from tests.rewards.test_reward_models import build_rm

        build_rm(tmp_path / "rm")
        overrides.append(f"reward.kwargs.path={tmp_path / 'rm'}")
    cfg = load_config(path, overrides)
    assert cfg.data.task is not None
    get_task(cfg.data.task)
    assert callable(reward_function(cfg))
    rows = task_rows(cfg, "test")
    assert len(rows) == 5 and all("prompt" in r and "answer" in r for r in rows)


GSM8K_QWEN = Path(__file__).parents[1] / "examples" / "gsm8k_qwen.yaml"
# the example as it is, shrunk to a CPU-sized run: only sizes change, not the precision settings
SCALED_DOWN = [
    "model.path=tiny:nano",
    "model.threads=1",
    "run.steps=2",
    "run.eval_every=0",
    "run.save_model=false",
    "run.checkpoint_every=0",
    "rollout.batch_prompts=2",
    "rollout.n=2",
    "rollout.max_new_tokens=8",
    "train.mini_batches=2",
    "train.micro_batch_tokens=256",
    "train.warmup_steps=1",
    "data.train_size=4",
    "data.eval_size=2",
    "data.max_prompt_tokens=200",
    "data.on_long_prompt=truncate",
    "eval.max_new_tokens=4",
    "telemetry.console=false",
]


def test_gsm8k_qwen_runs_with_mixed_precision_scaled_down(tmp_path):
    """The example's own precision and memory settings, run for real on a tiny model."""
    import weir

    cfg = load_config(GSM8K_QWEN)
    assert "Qwen2.5-0.5B-Instruct" in cfg.model.path and cfg.model.dtype is None
    t = cfg.train
    assert (t.param_dtype, t.compute_dtype, cfg.engine.dtype) == ("float32", "bfloat16", "bfloat16")
    assert t.gradient_checkpointing and cfg.reward.function == "math"

    def even_tokens(sample, row):  # a tiny model never solves GSM8K: a reward with some spread
        return sum(t % 2 == 0 for t in sample.response_ids) / max(1, len(sample.response_ids))

    result = weir.run(GSM8K_QWEN, [*SCALED_DOWN, f"run.dir={tmp_path}"], reward=even_tokens)
    steps = [h for h in result.history if "train/grad_norm" in h]
    assert len(steps) == 2
    assert all(math.isfinite(h["train/grad_norm"]) and h["train/grad_norm"] > 0 for h in steps)
    # the bf16 engine's log-probs against the trainer's bf16-autocast ones on fp32 weights
    assert all(h["mismatch/abs_logp_diff"] < 0.05 for h in steps)
