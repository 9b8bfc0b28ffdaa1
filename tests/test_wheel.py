"""`pip install weir` (a wheel, not the checkout) runs the demo: what the CLI needs ships inside the
package. The wheel is built from a copy of the checkout and installed into an environment of its own,
which borrows this environment's dependencies (torch and the rest, as a plain path: never this
checkout's editable weir), and the demo runs from a directory outside the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(
    ".git", ".venv*", "runs", "build", "dist", "*.egg-info", "__pycache__", ".*cache", ".hypothesis"
)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd}\n{res.stdout}\n{res.stderr}"
    return res.stdout + res.stderr


@pytest.mark.slow
def test_the_installed_wheel_runs_the_demo_from_another_directory(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=SKIP)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src)],
        src,
        env,
    )
    (wheel,) = tmp_path.glob("weir-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        tmp_path,
        env,
    )
    # this environment's packages as a plain path: no .pth of it runs, so no editable weir
    Path(site.strip(), "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        [*pip, "--python", str(python), "install", "--no-deps", "--no-compile", str(wheel)],
        tmp_path,
        env,
    )

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run(
        [str(python), "-c", "import weir.loop.demo as d; print(d.__file__); print(d.EXAMPLES)"],
        elsewhere,
        env,
    ).split()
    assert all(p.startswith(str(venv)) for p in where[:2]), where  # the wheel's weir, not ours
    weir = str(venv / "bin" / "weir")
    assert "--task" in _run([weir, "demo", "--help"], elsewhere, env)
    small = ["model.path=tiny:nano", "sft.rows=64", "sft.epochs=1", "run.steps=1"]
    small += ["data.eval_size=4", "rollout.batch_prompts=4", "rollout.n=2", "run.eval_every=1"]
    _run([weir, "demo", "--out", "demo", *small], elsewhere, env)
    summary = json.loads((elsewhere / "demo" / "demo.json").read_text())
    assert summary["rl_steps"] == 1 and summary["eval_prompts"] == 4
