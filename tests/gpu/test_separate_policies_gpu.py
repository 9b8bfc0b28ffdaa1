"""multi_agent.policies=separate on one GPU: two roles, each with its own model, trainer and
engine on the device (bf16 engines, fp32 master weights), in the sync loop with the engines asleep
while the trainers train, and in the async loop with each engine on its own copy."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import weir

SCORER_PATH = "weir_gpu_separate_scorer"


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    import sys

    root = tmp_path_factory.mktemp("gpu_separate")
    (root / f"{SCORER_PATH}.py").write_text(
        "def score(episode, row):\n"
        "    turns = {t.role: t for t in episode.turns}\n"
        "    own = lambda r: float(r in turns and turns[r].finish_reason == 'stop')\n"
        "    return {'team': own('a'), 'a': own('a'), 'b': own('b')}\n"
    )
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


def _config(mode: str) -> dict:
    return {
        "run": {"steps": 3, "eval_every": 0, "checkpoint_every": 0},
        "model": {"path": "tiny:small"},
        "data": {"task": "arithmetic", "eval_size": 8},
        "rollout": {
            "function": "weir.rollout.multi_agent:rollout",
            "n": 8,
            "batch_prompts": 8,
            "max_new_tokens": 8,
        },
        "multi_agent": {
            "roles": [{"name": "a", "prompt": "answer"}, {"name": "b", "prompt": "check"}],
            "scorer": f"{SCORER_PATH}:score",
            "credit": "role",
            "policies": "separate",
            "max_tokens": 32,
        },
        "train": {"device": "cuda", "lr": 1.0e-4},
        "engine": {"dtype": "bfloat16", "sleep_while_training": True},
        "loop": {"mode": mode},
        "telemetry": {"console": False},
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_separate_policies_train_on_the_gpu(scorer, mode):
    result = weir.run(_config(mode), [f"run.dir={scorer / mode}"])
    hist = [h for h in result.history if "train/a/samples" in h]
    assert len(hist) == 3
    assert all(h["train/a/samples"] == 64 for h in hist)
    # bf16 engines against fp32 trainers: log-probs close, not equal. Only where the samples came
    # from the weights being trained: a stale sample's difference is also the policy's own change.
    fresh = [h for h in hist if h.get("staleness/a/max", h.get("staleness/max", 0)) == 0]
    assert fresh and (mode == "async" or len(fresh) == 3)
    assert all(h["mismatch/a/abs_logp_diff"] < 5e-2 for h in fresh)
    a = load_file(result.dir / "model" / "a" / "model.safetensors")
    b = load_file(result.dir / "model" / "b" / "model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)
