"""PPO with a critic in the drivers: resume continues exactly, async runs; a critic sharing the
policy's FSDP2 backbone on Ray is refused up front."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

import weir
from tests.telemetry.test_metrics_doc import keys_written, undocumented
from weir.config import build_config

CONFIG = {
    "run": {
        "steps": 3,
        "eval_every": 2,
        "checkpoint_every": 2,
        "deterministic": True,
        "save_model": False,
    },
    "model": {"path": "tiny:nano", "threads": 1},
    "data": {"task": "arithmetic", "eval_size": 8},
    "rollout": {"n": 4, "batch_prompts": 4, "max_new_tokens": 6},
    "reward": {"function": "digit_reward.reward"},
    "algo": {"advantage": "gae", "advantage_options": {"gamma": 1.0, "lam": 0.95}},
    "critic": {"lr": 1e-3, "freeze_actor_steps": 1, "mini_batches": 2},
    "train": {"lr": 1e-3},
    "telemetry": {"console": False},
}

REWARD = """
def reward(sample, row):
    text = sample.response_text
    return sum(c.isdigit() for c in text) / max(len(text), 1)
"""


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "digit_reward.py").write_text(textwrap.dedent(REWARD))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resumed_run_with_a_critic_continues_exactly(workdir):
    reference = workdir / "reference"
    weir.run(CONFIG, [f"run.dir={reference}"])
    expected = (reference / "metrics.jsonl").read_bytes()
    lines = _lines(reference)
    assert [r["critic/actor_frozen"] for r in lines[1:]] == [1.0, 0.0, 0.0]
    assert all("critic/value_loss" in r and "policy/pg_loss" in r for r in lines[2:])
    assert undocumented(keys_written(reference)) == []  # docs/metrics.md names the critic's
    ckpt = reference / "checkpoints" / "step_00000002" / "critic"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "state.pt").exists()

    stopped = workdir / "stopped"
    weir.run(CONFIG, [f"run.dir={stopped}", "run.steps=2"])  # ends with a checkpoint at step 2
    weir.run(CONFIG, [f"run.dir={stopped}"])  # resumes from it: critic weights, optimizer, steps
    assert (stopped / "metrics.jsonl").read_bytes() == expected


def test_async_run_with_a_critic_on_the_shared_backbone_resumes(workdir):
    cfg = {
        **CONFIG,
        "run": {**CONFIG["run"], "steps": 2, "deterministic": False, "checkpoint_every": 2},
        "loop": {"mode": "async", "max_staleness": 1},
        "critic": {**CONFIG["critic"], "shared_backbone": True, "freeze_actor_steps": 2},
    }
    run_dir = workdir / "async"
    result = weir.run(cfg, [f"run.dir={run_dir}"])
    steps = [h for h in result.history if "critic/value_loss" in h]
    assert [h["critic/actor_frozen"] for h in steps] == [1.0, 1.0]
    head = run_dir / "checkpoints" / "step_00000002" / "critic" / "model.safetensors"
    assert head.exists()
    # resumed: the critic's step counter comes back, so its warm-up (2 steps) is over at step 3
    result = weir.run(cfg, [f"run.dir={run_dir}", "run.steps=3"])
    last = result.history[-1] if "critic/value_loss" in result.history[-1] else result.history[-2]
    assert last["critic/actor_frozen"] == 0.0 and "policy/pg_loss" in last


def test_a_critic_sharing_the_sharded_backbone_on_ray_is_refused_in_one_line():
    with pytest.raises(ValueError, match="set critic.shared_backbone=false"):
        build_config({}, ["algo.advantage=gae", "cluster.type=ray", "critic.shared_backbone=true"])
    with pytest.raises(ValueError, match="critic.mini_batches=3 must divide"):
        build_config({}, ["algo.advantage=gae", "critic.mini_batches=3"])


def test_example_config_is_ppo_with_a_critic():
    path = Path(__file__).parents[2] / "examples" / "ppo_critic.yaml"
    cfg = build_config(yaml.safe_load(path.read_text()), [])
    assert cfg.algo.advantage == "gae" and cfg.critic.freeze_actor_steps > 0
