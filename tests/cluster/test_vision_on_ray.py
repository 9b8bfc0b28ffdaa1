"""A vision-language model on Ray: the driver encodes image prompts with the model's processor, the
engine replica (a Ray actor) gets the pixels with the prompt ids, two FSDP2 trainer ranks train on
the same ids and pixels, and every sync leaves the replica holding the trainer's weights."""

from __future__ import annotations

import json

import pytest

import weir


def _letters(sample, row) -> float:
    """A reward with spread on a random model's text: the share of ASCII letters."""
    text = sample.response_text
    return sum(c.isascii() and c.isalpha() for c in text) / max(len(text), 1)


@pytest.mark.slow
def test_a_vision_language_model_trains_on_ray(ray_local, tmp_path):
    result = weir.run(
        {
            "run": {"steps": 2, "eval_every": 0, "seed": 3, "save_model": False},
            "model": {"path": "tiny-vlm:nano", "threads": 1},
            "data": {"task": "shapes", "eval_size": 2, "task_options": {"questions": "colour"}},
            "rollout": {"n": 3, "batch_prompts": 2, "max_new_tokens": 4, "temperature": 1.0},
            "train": {"lr": 2e-3},
            "telemetry": {"console": False, "trace": False, "dump_rollouts": True},
        },
        [
            f"run.dir={tmp_path}",
            "cluster.type=ray",
            "cluster.trainer.ranks=2",
            "cluster.trainer.cpus_per_rank=0.5",
            "cluster.engines.cpus=0.5",
            "cluster.reward_workers=0",
            "cluster.verify_sync=true",
        ],
        reward=_letters,
    )
    steps = [h for h in result.history if "train/loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["sync/verified"] == 1.0 and h["batch/samples"] > 0
        # the trainer reads the prompts' pixels: an engine that had not seen them would sample
        # from another distribution, orders of magnitude off
        assert h["mismatch/abs_logp_diff"] < 1e-5
    dump = (tmp_path / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    assert dump and all(json.loads(x)["images"] for x in dump)  # every prompt had its image
