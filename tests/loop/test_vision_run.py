"""A vision-language RL run end to end on the tiny Qwen2.5-VL: sync and async loops train on image
prompts with engine and trainer in agreement, a run stopped after a checkpoint resumes to the same
numbers as one never stopped, and the saved model directory loads back with its processor."""

from __future__ import annotations

import pytest
import torch

import weir
from weir.buffer.buffer import _group_from_dict, _group_to_dict
from weir.data.sample import Group, Sample
from weir.data.vision import encode_vision_prompt, processor_of
from weir.tasks.shapes import make_rows
from weir.train.model import load_model


def _config(tmp_path, name: str, steps: int, **extra) -> dict:
    cfg = {
        "run": {
            "dir": str(tmp_path / name),
            "steps": steps,
            "eval_every": 0,
            "checkpoint_every": 1,
            "deterministic": True,
            "seed": 3,
        },
        "model": {"path": "tiny-vlm:nano", "threads": 1},
        "data": {"task": "shapes", "eval_size": 2, "task_options": {"questions": "colour"}},
        "rollout": {"n": 3, "batch_prompts": 2, "max_new_tokens": 4, "temperature": 1.0},
        "train": {"lr": 2e-3},
        "telemetry": {"console": False},
    }
    for key, value in extra.items():
        section, field = key.split(".")
        cfg.setdefault(section, {})[field] = value
    return cfg


def _letters(sample, row) -> float:
    """A reward with spread on a random model's text: the share of ASCII letters."""
    text = sample.response_text
    return sum(c.isascii() and c.isalpha() for c in text) / max(len(text), 1)


@pytest.mark.slow
def test_sync_run_resume_and_saved_model(tmp_path):
    full = weir.run(_config(tmp_path, "full", 2), reward=_letters)
    steps = [h for h in full.history if "reward/mean" in h]
    assert len(steps) == 2
    for step in steps:
        assert step["reward/std"] > 0 and step["batch/samples"] > 0
        assert step["mismatch/abs_logp_diff"] < 1e-5  # engine vs trainer, images included
    # stop after 1 step (checkpoint), then resume the same directory to 2
    weir.run(_config(tmp_path, "cut", 1), reward=_letters)
    resumed = weir.run(_config(tmp_path, "cut", 2), reward=_letters)
    a, b = full.history[-1], resumed.history[-1]
    for key in ("reward/mean", "train/loss", "train/grad_norm"):
        assert a[key] == pytest.approx(b[key], abs=1e-6), key
    assert full.evals[-1]["eval/reward"] == resumed.evals[-1]["eval/reward"]

    from weir.train.export import export_model

    exported = export_model(full.dir, full.dir.parent / "exported")
    model, tok = load_model(str(exported))
    processor = processor_of(tok)
    assert processor is not None, "the saved directory must hold the image processor"
    row = make_rows("test", 1, 0, questions="colour")[0]
    ids, vision = encode_vision_prompt(processor, row)
    assert vision is not None and vision.tensors["image_grid_thw"].tolist() == [[1, 4, 4]]  # 32x32
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([ids]), **vision.tensors).logits).all()


def test_buffered_groups_keep_their_pixels():
    """The async loop's checkpoint stores buffered groups as plain dicts (torch.save)."""
    from weir.tasks.tiny_vlm import build_vlm_processor

    row = make_rows("train", 1, 0)[0]
    ids, vision = encode_vision_prompt(build_vlm_processor(), row)
    g = Group([Sample(ids, [5, 6], reward=1.0, vision=vision) for _ in range(2)], row=row)
    back = _group_from_dict(_group_to_dict(g))
    assert all(s.vision.equal(vision) and s.vision.images == vision.images for s in back.samples)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("engine.type=vllm", "completions endpoint, which carries no images"),
        (
            "rollout.function=weir.rollout.multi_agent:rollout;multi_agent.roles=[{name: a}]",
            "multi-agent",
        ),
    ],
)
def test_runs_that_would_drop_images_are_refused(override, match):
    from weir.config import load_config
    from weir.loop.components import _check_vision_run

    _check_vision_run(load_config(None, []))  # the defaults keep images
    _check_vision_run(load_config(None, ["rollout.function=weir.rollout.multi_turn:rollout"]))
    _check_vision_run(load_config(None, ["cluster.type=ray"]))  # Ray replicas take the pixels
    with pytest.raises(ValueError, match=match):
        _check_vision_run(load_config(None, override.split(";")))
