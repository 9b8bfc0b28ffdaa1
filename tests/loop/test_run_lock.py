"""One run per run directory: a second run on a live run's directory is refused with one line naming
the directory and the process that holds it; a killed run's lock does not block the resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import weir
from weir.cli.main import app
from weir.loop.run import RunError
from weir.loop.run_lock import LOCK_NAME, RunDirInUse, RunLock

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no flock on Windows")

CONFIG = {
    "run": {"steps": 400, "eval_every": 0, "checkpoint_every": 1, "save_model": False},
    "model": {"path": "tiny:nano", "threads": 1},
    "data": {"task": "arithmetic", "eval_size": 2},
    "rollout": {"n": 2, "batch_prompts": 2, "max_new_tokens": 4},
    "telemetry": {"console": False},
}


def test_the_lock_is_exclusive_until_released(tmp_path):
    first = RunLock.acquire(tmp_path / "run")  # creates the directory
    with pytest.raises(RunDirInUse, match=f"pid {os.getpid()} on "):
        RunLock.acquire(tmp_path / "run")  # a second open file description: refused
    first.release()
    again = RunLock.acquire(tmp_path / "run")
    assert again.held and (tmp_path / "run" / LOCK_NAME).read_text().startswith(
        f"pid {os.getpid()}"
    )
    again.release()


def test_a_run_releases_its_lock_when_it_fails_to_open(tmp_path):
    """Run.open refusing (metrics already there, no overwrite) leaves the directory unlocked."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    cfg = weir.load_config(None, [f"run.dir={run_dir}", "run.resume=never", "run.overwrite=false"])
    from weir.loop.run import Run

    with pytest.raises(RunError, match="already has metrics"):
        Run.open(cfg)
    RunLock.acquire(run_dir).release()


def _holder(run_dir: Path) -> subprocess.Popen:
    """A real `weir train` on `run_dir`, waited for until its first checkpoint is written."""
    config = run_dir.parent / "run.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    proc = subprocess.Popen(
        [sys.executable, "-m", "weir.cli.main", "train", str(config), f"run.dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not list((run_dir / "checkpoints").glob("step_*")):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the first run never wrote a checkpoint"
        time.sleep(0.05)
    return proc


@pytest.mark.slow
def test_a_second_run_is_refused_and_a_killed_runs_lock_does_not_block_the_resume(tmp_path, capfd):
    run_dir = tmp_path / "run"
    proc = _holder(run_dir)
    try:
        config = (run_dir / "config.yaml").read_text()
        # the same command in another terminal: one line, the directory and the holder's pid
        res = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml"), f"run.dir={run_dir}"])
        assert res.exit_code == 1, res.output
        line = " ".join(res.output.split())
        assert str(run_dir) in line and f"pid {proc.pid} " in line, line
        assert "Traceback" not in res.output
        # on Ray too: the driver takes the lock before any placement starts
        with pytest.raises(RunError, match=f"pid {proc.pid} "):
            weir.run(str(tmp_path / "run.yaml"), [f"run.dir={run_dir}", "cluster.type=ray"])
        assert (run_dir / "config.yaml").read_text() == config  # the refused runs wrote nothing
        assert proc.poll() is None  # and the first run goes on
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert (run_dir / LOCK_NAME).exists()  # the killed run's lock file stays, its lock does not
    last = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    weir.run(str(tmp_path / "run.yaml"), [f"run.dir={run_dir}", f"run.steps={last + 1}"])
    assert f"resumed from {run_dir / 'checkpoints'}" in capfd.readouterr().err
    logged = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert logged == sorted(set(logged)) and logged[-1] == last + 1
    RunLock.acquire(run_dir).release()  # the resumed run let its lock go at the end
