"""Run a test's trainer ranks as processes of their own (real gloo collectives, no Ray)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from weir.train.distributed import free_port

ROOT = Path(__file__).parents[2]


def run_ranks(script: Path, args: list[str], world: int, timeout: float) -> list[tuple[int, str]]:
    """Start ``python SCRIPT RANK WORLD PORT *ARGS`` for every rank on a fresh port and wait for
    all; each rank's (exit code, output). Ranks still running after `timeout` seconds are killed
    and the test fails: a collective went out of step. A port taken between `free_port` and the
    rendezvous (other jobs on the machine) gets one more try on another port."""
    results = _run_once(script, args, world, timeout)
    if any("Address already in use" in o for _, o in results):
        results = _run_once(script, args, world, timeout)
    return results


def _run_once(script: Path, args: list[str], world: int, timeout: float) -> list[tuple[int, str]]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), str(port), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(
            f"the ranks of {script.name} hung for {timeout:.0f} s: a collective went out of step"
        )
    return [(p.returncode, o) for p, o in zip(procs, outputs, strict=True)]
