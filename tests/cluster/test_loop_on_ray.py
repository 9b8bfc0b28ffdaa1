"""`cluster.type=ray` runs the same config through run_sync and run_async on Ray actors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

import weir
from weir.sync import weights_hash

SMALL = {
    "run": {"steps": 2, "eval_every": 0, "save_model": True, "seed": 3},
    "model": {"path": "tiny:nano", "threads": 1},
    "data": {"task": "arithmetic", "eval_size": 4},
    "rollout": {"n": 2, "batch_prompts": 4, "max_new_tokens": 4},
    "telemetry": {"console": False},
}
RAY_KEYS = ("cluster/engine_retries", "cluster/engine_restarts")
RAY = [
    "cluster.type=ray",
    "cluster.trainer.ranks=2",
    "cluster.engines.replicas=2",
    "cluster.trainer.cpus_per_rank=0.5",
    "cluster.engines.cpus=0.5",
]


def _parity(sample, row) -> float:
    """A reward with spread in every group (an untrained model never gets arithmetic right): 1 for
    each prompt's first sample. (The responses' parity gave both samples of a group the same reward
    now and then, and such a step has no gradient at all.)"""
    return float(sample.index == 0)


@pytest.mark.slow
@pytest.mark.parametrize(  # CI: the sync loop on Ray in tests/cluster/test_matrix_on_ray.py's cells
    "mode", [pytest.param("sync", marks=pytest.mark.heavy), "async"]
)
def test_the_loop_runs_on_ray(ray_local, tmp_path, mode):
    # sync: colocated (engines asleep while the ranks train, weights by shared-memory handle);
    # async: disaggregated (weights through the broadcast group)
    placement = [f"cluster.colocate={mode == 'sync'}"]
    result = weir.run(
        {**SMALL, "loop": {"mode": mode}},
        [f"run.dir={tmp_path}", *RAY, *placement],
        reward=_parity,
    )
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 2
    assert all(h["sync/mb"] > 0 and h["train/grad_norm"] > 0 for h in steps)
    assert all(h["cluster/engine_retries"] == 0 for h in steps)
    # the saved model is the trained one (fetched from the FSDP2 ranks), not the initial one
    saved = AutoModelForCausalLM.from_pretrained(result.model_dir).state_dict()
    models = tmp_path.parent / ".models"
    initial = AutoModelForCausalLM.from_pretrained(models / "tiny-nano-qwen3-seed0").state_dict()
    assert weights_hash(saved) != weights_hash(initial)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("sync/mb_per_s" in x for x in lines)
    doc = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    for key in ("sync/gather_s", "sync/deliver_s", "sync/mb", "sync/mb_per_s", *RAY_KEYS):
        assert any(key in x for x in lines) and f"| `{key}` |" in doc, key
    if mode == "sync":  # resume from the final checkpoint: weights and optimizer go to the ranks
        more = weir.run(
            {**SMALL, "run": {**SMALL["run"], "steps": 3}},
            [f"run.dir={tmp_path}", *RAY, *placement],
            reward=_parity,
        )
        lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines if "reward/mean" in x] == [1, 2, 3]
        assert more.model_dir is not None
