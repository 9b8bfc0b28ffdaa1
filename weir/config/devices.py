"""Device and dtype names from the config (`auto`, `cpu`, `cuda:1`, `bfloat16`) -> torch objects.

Shared by the trainer and the engines, so that `auto` means the same thing on both sides.
"""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(spec: str, *, key: str = "device") -> torch.device:
    """`auto` -> the current CUDA device when CUDA is available, else the CPU; otherwise the named one,
    with an index (`cuda` -> the current CUDA device: a tensor there reports `cuda:N`, and
    `torch.cuda.set_device` wants one).

    A CUDA device asked for on a machine without CUDA is a config error, reported as one line.
    """
    if spec == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if cuda_available()
            else torch.device("cpu")
        )
    device = torch.device(spec)
    if device.type == "cuda":
        if not cuda_available():
            raise ValueError(
                f"{key}={spec}: this machine has no CUDA device; use {key}=cpu or auto"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"{key}={spec}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_dtype(
    spec: str | None, device: torch.device, *, gpu_default: str = "bfloat16"
) -> torch.dtype:
    """`auto` (or None) -> `gpu_default` on CUDA, float32 elsewhere; otherwise the named dtype."""
    if spec in (None, "auto"):
        return DTYPES[gpu_default] if device.type == "cuda" else torch.float32
    return DTYPES[spec]


def set_cudnn_attention(device: torch.device, enabled: bool) -> bool:
    """Allow or forbid cuDNN's backend of `scaled_dot_product_attention` for this process when
    `device` is a CUDA device (`model.cudnn_attention`); returns whether the flag was set.

    cuDNN's attention builds an execution plan per distinct shape. A decode step's KV grows by one
    column every step and padded training batches change length, so every call can be a new plan:
    on an H100 (torch 2.11) the built-in engine spent 75% of each ~100 ms decode step of a
    0.5B-shaped model inside that call, whatever the number of rows. The flash and
    memory-efficient backends need no plan.
    """
    if device.type != "cuda":
        return False
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    return True


def choose_backends(device: torch.device, *, deterministic: bool, cudnn_attention: bool) -> bool:
    """The backend settings every process of a run that computes on `device` takes, trainer rank
    or engine (a process starts from torch's defaults): TF32 matmuls on CUDA unless the run is
    deterministic (`enable_tf32`), cuDNN attention only when asked (`set_cudnn_attention`).
    Returns whether TF32 was turned on."""
    tf32 = enable_tf32(device, deterministic=deterministic)
    set_cudnn_attention(device, cudnn_attention)
    return tf32


def enable_tf32(device: torch.device, *, deterministic: bool) -> bool:
    """Let float32 matmuls and convolutions use TF32 tensor cores on CUDA (Ampere and newer).

    TF32 keeps float32's range with a 10-bit mantissa in the multiply, as cuBLAS does by default
    for most frameworks. Off in deterministic runs (exact float32 numbers are part of the claim).
    Returns whether it was turned on.
    """
    if device.type != "cuda" or deterministic:
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def rounding_tolerance(dtype: torch.dtype, device: torch.device | None = None) -> float:
    """Largest mean log-prob difference (nats per token) accepted as rounding between two exact
    ways of computing one forward (packed vs alone, prefix vs padded, engine vs trainer).

    1e-4 in float32; 2e-2 where the matmuls keep about 10 mantissa bits or fewer: bfloat16,
    float16, and float32 on CUDA with TF32 matmuls on (`enable_tf32`). A wrong mask (a missing
    sliding window, sequences not kept apart) moves log-probs by 0.17-0.46 nats per token on the
    tiny models of docs/models.md, so both bounds still tell that apart.
    """
    if dtype != torch.float32:
        return 2e-2
    tf32 = device is not None and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return 2e-2 if tf32 else 1e-4


def backend_flags() -> dict[str, Any]:
    """This process's torch settings that choose kernels or change numbers (TF32, the attention
    backends of `scaled_dot_product_attention`, deterministic algorithms).

    They are process-global and a `spawn`ed child starts with torch's defaults, so a child that
    computes for this process (the engine with `engine.process=true`) takes them with
    `apply_backend_flags`; otherwise, on CUDA, it would run with TF32 off and cuDNN attention on
    while the engine in a thread of this process runs with what `setup_device` chose.
    """
    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
        "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient_sdp": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math_sdp": torch.backends.cuda.math_sdp_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    }


def apply_backend_flags(flags: dict[str, Any]) -> None:
    """Set this process's torch settings to `flags` (from `backend_flags` in another process)."""
    torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
    torch.backends.cuda.matmul.allow_tf32 = flags["cuda_matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn_allow_tf32"]
    torch.backends.cuda.enable_cudnn_sdp(flags["cudnn_sdp"])
    torch.backends.cuda.enable_flash_sdp(flags["flash_sdp"])
    torch.backends.cuda.enable_mem_efficient_sdp(flags["mem_efficient_sdp"])
    torch.backends.cuda.enable_math_sdp(flags["math_sdp"])
    torch.use_deterministic_algorithms(
        flags["deterministic"], warn_only=flags["deterministic_warn_only"]
    )


def release_cached_memory(device: torch.device, *, workspaces: bool = True) -> None:
    """Give this process's idle CUDA memory on `device` back to the device (no-op elsewhere): the
    blocks torch's caching allocator keeps and, with `workspaces`, cuBLAS's workspaces. Those are
    32 MiB per handle and stream on a Hopper GPU and count as allocated: without this an offloaded
    trainer rank kept 65 MiB, a sleeping engine 132 MiB (H200, torch 2.11). cuBLAS allocates them
    again on its next call. Clear them only when no other thread of this process computes on the
    device, and after dropping any CUDA graph captured with one."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if workspaces and clear is not None:
        clear()
    torch.cuda.empty_cache()
