"""The Triton log-prob kernels (`kernel="triton"`) in Triton's interpreter on the CPU: the cases
of tests/algo/triton_cases.py, run in a fresh process with TRITON_INTERPRET=1.

Triton makes its language's own functions (`tl.max`, `tl.sum`) interpreted or compiled when it is
first imported, by TRITON_INTERPRET at that moment; in a test worker an earlier test's
torch.compile may have imported it already, compiled-only (a full run failed every case so:
"Cannot call @triton.jit'd outside of the scope of a kernel"). A process of its own always starts
with the interpreter."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("triton_cases.py")
ROOT = Path(__file__).resolve().parents[2]


def test_the_triton_kernels_equal_the_reference_in_the_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (pip install 'weir[dev]'): its interpreter runs these")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 25, out[-3000:]  # every case ran, none skipped
    assert "skipped" not in out.splitlines()[-1], out[-3000:]
