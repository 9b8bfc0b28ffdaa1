"""Lose nothing: a run killed at any point (SIGKILL, mid-checkpoint-write, SIGTERM) and resumed writes
exactly the metrics of the run that was never killed; the same seed and config give the same bytes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

import weir
from weir.train.checkpoint import list_checkpoints

STEPS = 6
CONFIG = {
    "run": {
        "steps": STEPS,
        "eval_every": 3,
        "checkpoint_every": 1,
        "keep_checkpoints": 2,
        "deterministic": True,
        "save_model": False,
    },
    "model": {"path": "tiny:nano", "threads": 1},
    "data": {"task": "arithmetic", "eval_size": 8},
    "rollout": {"n": 4, "batch_prompts": 4, "max_new_tokens": 6},
    "reward": {"function": "digit_reward.reward"},
    "train": {"lr": 1e-3},
    "telemetry": {"console": False},
}

REWARD = """
def reward(sample, row):
    # random text has a varying share of digits: a reward with spread, so every step really updates
    text = sample.response_text
    return sum(c.isdigit() for c in text) / max(len(text), 1)
"""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "digit_reward.py").write_text(textwrap.dedent(REWARD))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(CONFIG))
    return tmp_path


def _env(workdir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(workdir), *filter(None, [env.get("PYTHONPATH", "")])])
    env.pop("WEIR_FAULT", None)
    env.update(extra)
    return env


def _train(workdir: Path, run_dir: Path, **env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "weir.cli.main", "train", str(workdir / "run.yaml")]
    return subprocess.Popen(
        [*cmd, f"run.dir={run_dir}"],
        cwd=workdir,
        env=_env(workdir, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return -1
    steps = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            steps.append(json.loads(line)["step"])
    return max(steps, default=-1)


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while _steps_logged(run_dir) < step:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"step {step} never logged"
        time.sleep(0.02)


@pytest.mark.slow
def test_killed_anywhere_and_resumed_equals_uninterrupted(workdir: Path):
    reference = workdir / "reference"
    code, out = _finish(_train(workdir, reference))
    assert code == 0, out
    expected = (reference / "metrics.jsonl").read_bytes()
    assert len(expected.splitlines()) == STEPS + 1  # the initial evaluation, then one line per step

    run = workdir / "killed"
    # 1. SIGKILL after step 2's files are written but before its manifest: the checkpoint is incomplete
    code, out = _finish(_train(workdir, run, WEIR_FAULT="checkpoint_files:2"))
    assert code == -signal.SIGKILL, out
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [1]
    assert list((run / "checkpoints").glob(".tmp-step_*"))  # the torn write is still there

    # 2. resume (from step 1); SIGKILL after step 3's manifest, before the rename makes it visible
    code, out = _finish(_train(workdir, run, WEIR_FAULT="checkpoint_manifest:3"))
    assert code == -signal.SIGKILL, out
    assert "resumed from" in out and "step_00000001" in out

    # 3. resume (from step 2); SIGKILL at a moment the test does not choose: as soon as step 4 is logged
    proc = _train(workdir, run)
    _wait_for_step(proc, run, 4)
    proc.send_signal(signal.SIGKILL)
    _finish(proc)

    # 4. resume; SIGTERM after step 5 is logged: the step finishes, a checkpoint is written, exit 0
    proc = _train(workdir, run)
    _wait_for_step(proc, run, 5)
    proc.send_signal(signal.SIGTERM)
    code, out = _finish(proc)
    assert code == 0, out
    assert "SIGTERM received" in out and "Resume with the same command" in out
    stopped_at = _steps_logged(run)
    assert [s for s, _ in list_checkpoints(run / "checkpoints")][-1] == stopped_at

    # 5. resume to the end
    code, out = _finish(_train(workdir, run))
    assert code == 0, out
    assert f"resumed from {run / 'checkpoints'}" in out
    assert (run / "metrics.jsonl").read_bytes() == expected
    assert not list((run / "checkpoints").glob(".tmp-step_*"))  # torn writes were cleaned up
    assert len(list_checkpoints(run / "checkpoints")) == 2  # keep_checkpoints


def test_same_seed_same_bytes(workdir: Path, monkeypatch):
    monkeypatch.syspath_prepend(str(workdir))
    cfg = {**CONFIG, "run": {**CONFIG["run"], "steps": 3, "checkpoint_every": 0}}
    first = weir.run(cfg, [f"run.dir={workdir / 'a'}"])
    second = weir.run(cfg, [f"run.dir={workdir / 'b'}"])
    a, b = (
        (workdir / "a" / "metrics.jsonl").read_bytes(),
        (workdir / "b" / "metrics.jsonl").read_bytes(),
    )
    assert a == b
    assert len(first.history) == len(second.history) == 4
    records = [json.loads(line) for line in a.splitlines()]
    assert not any(k.startswith(("time/", "throughput/")) for r in records for k in r)
    timings = [
        json.loads(line) for line in (workdir / "a" / "timings.jsonl").read_text().splitlines()
    ]
    assert [t["step"] for t in timings] == [r["step"] for r in records]
    assert all("time/step" in t for t in timings)
    assert first.history[1]["time/generate"] > 0  # the in-memory history has both
