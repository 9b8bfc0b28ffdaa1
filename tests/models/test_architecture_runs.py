"""Every architecture weir claims, as a user runs it: `weir train` for 2 steps, SIGKILLed while writing
step 2's checkpoint and resumed from step 1 (the metrics equal the uninterrupted run's), then
`weir export`, reloaded by `AutoModelForCausalLM`, with the logits of the trained weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import weir
from weir.loop.checkpointing import load_weights
from weir.tasks.tiny_archs import ARCHS, build_arch_model
from weir.train.checkpoint import latest_checkpoint, list_checkpoints
from weir.train.export import export_model

CONFIG = {
    "run": {
        "steps": 2,
        "eval_every": 0,
        "checkpoint_every": 1,
        "keep_checkpoints": 2,
        "deterministic": True,
        "save_model": False,
    },
    "model": {"threads": 1},
    "data": {"task": "arithmetic", "eval_size": 2},
    "rollout": {"n": 4, "batch_prompts": 2, "max_new_tokens": 12},
    "reward": {"function": "arch_reward.reward"},
    "train": {"lr": 1e-2},
    "telemetry": {"console": False},
}

REWARD = """
def reward(sample, row):
    # spread over the samples of a random model's group, so every step really updates
    return (sum(sample.response_ids) % 7) / 6
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("arch_runs")
    (root / "arch_reward.py").write_text(textwrap.dedent(REWARD))
    (root / "run.yaml").write_text(yaml.safe_dump(CONFIG))
    return root


def _kill_at_step_2(workdir: Path, model_dir: Path, run_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(workdir), env.get("PYTHONPATH", "")])
    env["WEIR_FAULT"] = "checkpoint_files:2"  # SIGKILL after step 2's files, before its manifest
    cmd = [sys.executable, "-m", "weir.cli.main", "train", str(workdir / "run.yaml")]
    cmd += [f"run.dir={run_dir}", f"model.path={model_dir}"]
    return subprocess.run(
        cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_train_kill_resume_export(workdir, monkeypatch, name):
    monkeypatch.syspath_prepend(str(workdir))
    model_dir = build_arch_model(workdir / "models" / name, name, seed=0)
    over = [f"model.path={model_dir}"]

    reference = workdir / "runs" / f"{name}-reference"
    weir.run(CONFIG, [*over, f"run.dir={reference}"])
    records = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-2:] == [1, 2]
    assert all(r["train/grad_norm"] > 0 for r in records if "train/grad_norm" in r)

    killed = workdir / "runs" / f"{name}-killed"
    proc = _kill_at_step_2(workdir, model_dir, killed)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert [s for s, _ in list_checkpoints(killed / "checkpoints")] == [1]
    weir.run(CONFIG, [*over, f"run.dir={killed}"])  # resumes from step 1
    assert (killed / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()

    ckpt, _ = latest_checkpoint(killed / "checkpoints")
    exported = export_model(killed, workdir / "exports" / name)
    hf = AutoModelForCausalLM.from_pretrained(exported).eval()
    trained = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    load_weights(trained, ckpt / "model")  # the resume path: transformers' own key mapping
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(6, 262, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = hf(ids).logits, trained(ids).logits
        assert (got - want).abs().max().item() <= 1e-5
        assert (
            got - base(ids).logits
        ).abs().max().item() > 1e-3  # the export holds trained weights
