"""The Triton log-prob kernels (`kernel="triton"`) on a CPU: their values in Triton's interpreter
(the cases of tests/algo/triton_cases.py, run in a fresh process with TRITON_INTERPRET=1), and
their builds by Triton's real compiler for A100 and H100 GPUs (tests/algo/triton_compile.py).

Triton makes its language's own functions (`tl.max`, `tl.sum`) interpreted or compiled when it is
first imported, by TRITON_INTERPRET at that moment; in a test worker an earlier test's
torch.compile may have imported it already, compiled-only (a full run failed every case so:
"Cannot call @triton.jit'd outside of the scope of a kernel"). A process of its own always starts
with the interpreter."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("triton_cases.py")
BUILDS = Path(__file__).with_name("triton_compile.py")
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


def test_the_triton_kernels_compile_for_gpus_without_spills(tmp_path):
    """What the interpreter cannot show: Triton's compiler takes the kernels (its type rules for
    loop-carried values, constexpr branches) down to a cubin for sm_80 and sm_90 in every dtype
    and mode, the blocks the GPU benchmark sweeps included; no register spills to local memory;
    a block's registers fit one SM's 64k (else the launch fails); 16-byte loads of the logits and
    16-byte stores of their gradient, as the launcher's alignment marks allow (a kernel that
    loaded 2 bytes at a time would not reach the bandwidth the kernels exist for)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (pip install 'weir[dev]'): its compiler builds these")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # every build compiles, none comes from a cache
    cmd = [sys.executable, str(BUILDS)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in rows if "error" in r]
    assert not failed, f"{len(failed)} builds failed, the first: {failed[0]}"
    assert run.returncode == 0, run.stderr[-4000:]
    assert len(rows) == 34, run.stdout[-3000:]
    assert {(r["arch"], r["dtype"]) for r in rows} >= {
        (a, d) for a in (80, 90) for d in ("fp32", "bf16", "fp16")
    }
    for r in rows:
        assert r["local"] == 0 and r["stack"] == 0, r  # spilled registers
        assert r["registers"] * r["warps"] * 32 <= 65536, r
        assert r["vector_loads"], r
        if r["kernel"] == "backward":
            assert r["vector_stores"], r
