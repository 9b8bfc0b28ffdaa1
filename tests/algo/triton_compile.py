"""Build weir's Triton log-prob kernels (`weir.algo.logprob_triton`) with Triton's own compiler
for NVIDIA GPUs on a machine without one: Python -> Triton IR -> LLVM -> PTX -> a cubin by the
`ptxas` that ships inside Triton's wheel. Nothing runs; what a build shows is that the kernels
compile as the GPU's first launch will compile them (the interpreter of tests/algo/triton_cases.py
checks their values, not that they compile), and what the cubin asks of the GPU (registers, local
memory: spilled registers).

Prints one JSON object per build: kernel, arch, dtype, mode, block, warps, registers, local bytes,
whether it loads and stores 16 bytes per instruction (vector loads). The types are those Triton's launcher infers
for the tensors and ints `stats` and `grad` pass (16-byte aligned pointers, a 151,936-column
vocabulary). Run by tests/algo/test_logprob_triton.py in a process of its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from weir.algo import logprob_triton as lt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import gpu_timing  # noqa: E402 - the block sizes and warps the GPU benchmark sweeps

VOCAB = 151_936  # Qwen2/2.5's: a multiple of 16, as the launcher then marks the strides
ARCHS = (80, 90)  # A100, H100/H200
DTYPES = ("fp32", "bf16", "fp16")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def fwd_signature(dtype: str) -> dict[str, str]:
    return {
        "X": f"*{dtype}",
        "stride_x": "i32",
        "IDS": "*i64",
        "M": "*fp32",
        "LOG_S": "*fp32",
        "LOGP": "*fp32",
        "H": "*fp32",
        "inv_t": "fp32",
        "V": "constexpr",
        "WITH_H": "constexpr",
        "BLOCK_V": "constexpr",
    }


def bwd_signature(dtype: str) -> dict[str, str]:
    return {
        "X": f"*{dtype}",
        "stride_x": "i32",
        "OUT": f"*{dtype}",
        "stride_out": "i32",
        "IDS": "*i64",
        "M": "*fp32",
        "LOG_S": "*fp32",
        "H": "*fp32",
        "G": "*fp32",
        "G_H": "*fp32",
        "V": "i32",
        "inv_t": "fp32",
        "WITH_GH": "constexpr",
        "BLOCK_V": "constexpr",
        "ROUND_BY_HAND": "constexpr",
    }


def aligned(signature: dict[str, str]) -> dict[tuple[int, ...], list[list]]:
    """Triton's launcher marks 16-byte aligned pointers and ints divisible by 16 so; the same
    marks here (pointers, strides and V)."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, t in enumerate(signature.values())
        if t.startswith("*") or t == "i32"
    }


def usage(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        cmd = [os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name]
        text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {text[-500:]}")
    return dict(
        zip(("registers", "stack", "shared", "local"), map(int, found.groups()), strict=True)
    )


def build(kernel: str, arch: int, dtype: str, mode: bool, block: int, warps: int) -> dict:
    fwd, bwd = lt._kernels(False)
    if kernel == "forward":
        fn, sig = fwd, fwd_signature(dtype)
        consts = {"V": VOCAB, "WITH_H": mode, "BLOCK_V": block}
    else:
        fn, sig = bwd, bwd_signature(dtype)
        consts = {"WITH_GH": mode, "BLOCK_V": block, "ROUND_BY_HAND": False}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned(sig)),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": warps},
    )
    ptx = compiled.asm["ptx"]
    return {
        "kernel": kernel,
        "arch": arch,
        "dtype": dtype,
        "mode": mode,
        "block": block,
        "warps": warps,
        "vector_loads": bool(re.search(r"ld\.global[\w.:]*\.v4\.b32", ptx)),
        "vector_stores": bool(re.search(r"st\.global[\w.:]*\.v4\.b32", ptx)),
        **usage(compiled.asm["cubin"]),
    }


def builds() -> list[tuple[str, int, str, bool, int, int]]:
    """(kernel, arch, dtype, mode, block, warps): every dtype and mode at the default blocks on
    each arch; the (block, warps) the GPU benchmark sweeps (benchmarks/gpu_timing.py) in
    bfloat16 on sm_90."""
    out = [
        (k, arch, dt, mode, block, lt._warps(block))
        for arch in ARCHS
        for dt in DTYPES
        for k, block in (("forward", lt.FWD_BLOCK_V), ("backward", lt.BWD_BLOCK_V))
        for mode in (False, True)
    ]
    sweep = [("forward", *c) for c in gpu_timing.FWD_CONFIGS]
    sweep += [("backward", *c) for c in gpu_timing.BWD_CONFIGS]
    return out + [(k, 90, "bf16", True, b, w) for k, b, w in sweep]


def main() -> int:
    failed = 0
    for case in builds():
        try:
            row = build(*case)
        except Exception as err:  # noqa: BLE001 - report every build, then fail
            failed += 1
            row = dict(
                zip(("kernel", "arch", "dtype", "mode", "block", "warps"), case, strict=True)
            )
            row["error"] = f"{type(err).__name__}: {err}"[:2000]
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
