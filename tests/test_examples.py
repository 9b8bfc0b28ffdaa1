"""Every config in examples/ validates, names a real task and reward, and its task builds data."""

from __future__ import annotations

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
def test_example_validates_and_builds_its_data(path):
    cfg = load_config(path, ["data.eval_size=5", "data.train_size=5"])
    assert cfg.data.task is not None
    get_task(cfg.data.task)
    assert callable(reward_function(cfg))
    rows = task_rows(cfg, "test")
    assert len(rows) == 5 and all("prompt" in r and "answer" in r for r in rows)


def test_gsm8k_qwen_is_a_real_model_run():
    cfg = load_config(Path(__file__).parents[1] / "examples" / "gsm8k_qwen.yaml")
    assert "Qwen2.5-0.5B-Instruct" in cfg.model.path
    assert cfg.model.dtype == "bfloat16" and cfg.reward.function == "math"
    assert cfg.rollout.batch_prompts * cfg.rollout.n % cfg.train.mini_batches == 0
