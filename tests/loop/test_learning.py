"""End to end on CPU: SFT warm start, then GRPO raises reward on an easy task within CI's time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import weir

EASY = str(Path(__file__).parents[2] / "examples" / "arithmetic_quick.yaml")
LORA = str(Path(__file__).parents[2] / "examples" / "lora.yaml")


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> Path:
    """The SFT warm start both learning runs begin from (the same sft section in both configs)."""
    return weir.sft(EASY, [f"run.dir={tmp_path_factory.mktemp('learning') / 'sft'}"])


@pytest.mark.slow
def test_grpo_raises_reward_after_sft(tmp_path, sft_model):
    result = weir.run(
        EASY, [f"run.dir={tmp_path / 'rl'}", f"model.path={sft_model}", "run.steps=20"]
    )
    rewards = [h["reward/mean"] for h in result.history if "reward/mean" in h]
    assert len(rewards) == 20
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert end > start + 0.1, rewards
    before, after = result.evals[0]["eval/accuracy"], result.evals[-1]["eval/accuracy"]
    assert after > before + 0.2, (before, after)
    lines = [json.loads(line) for line in (result.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(21))
    for key in (
        "reward/mean",
        "train/entropy",
        "policy/clipfrac_high",
        "mismatch/abs_logp_diff",
        "staleness/mean",
        "time/generate",
    ):
        assert key in lines[-1], key
    assert lines[-1]["mismatch/abs_logp_diff"] < 1e-4  # the built-in engine is on-policy
    assert (result.model_dir / "model.safetensors").exists()


@pytest.mark.slow
def test_lora_grpo_raises_reward_after_sft(tmp_path, sft_model):
    """LoRA adapters alone (base weights frozen) learn the task in 10 steps."""
    pytest.importorskip("peft")
    result = weir.run(
        LORA, [f"run.dir={tmp_path / 'lora'}", f"model.path={sft_model}", "run.steps=10"]
    )
    rewards = [h["reward/mean"] for h in result.history if "reward/mean" in h]
    assert len(rewards) == 10
    # Each step's reward is on other prompts (64 samples), so three steps' mean moves by about
    # 0.05 from batch to batch: the learning claim is the held-out accuracy, on the same problems
    # before and after (0.23 -> 0.67 on an AMD EPYC, where the reward rose by 0.077, 0.38 -> 0.46).
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert end > start, rewards
    before, after = result.evals[0]["eval/accuracy"], result.evals[-1]["eval/accuracy"]
    assert after > before + 0.3, (before, after)
    last = json.loads((result.dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["mismatch/abs_logp_diff"] < 1e-4  # the merged engine: on-policy to rounding
    base = AutoModelForCausalLM.from_pretrained(sft_model)
    trained = AutoModelForCausalLM.from_pretrained(result.model_dir)  # merged
    moved = {n for n, p in trained.named_parameters() if not torch.equal(p, base.get_parameter(n))}
    assert moved and all(n.endswith("proj.weight") for n in moved)  # only the adapted layers


@pytest.mark.slow
def test_minimal_grpo_example_learns(sft_model):
    """examples/minimal_grpo.py, the loop docs/concepts/flow.md reads, learns as `weir train` does:
    held-out greedy accuracy rose 0.11 -> 0.78 in 20 steps on the 2-core build machine."""
    import importlib.util

    path = Path(__file__).parents[2] / "examples" / "minimal_grpo.py"
    assert len(path.read_text().splitlines()) <= 120  # a loop to read, not a second driver
    spec = importlib.util.spec_from_file_location("minimal_grpo", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.grpo(str(sft_model), steps=20)
    assert result["accuracy_after"] > result["accuracy_before"] + 0.25, result
