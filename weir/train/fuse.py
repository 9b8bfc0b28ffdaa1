"""Fused element-wise work in the decoder (`train.fuse`): RMSNorm, RoPE, the gated MLP's
SiLU x up, their casts, run as a few fused kernels instead of dozens of memory-bound ones.

Two routes, each applied to the trainer's model in place before its first forward:

- `liger`: Liger's Triton kernels (`liger-kernel`, the `weir[liger]` extra) for RMSNorm and SwiGLU
  on the architectures it covers and weir has checked (`LIGER_ARCHS`); no compiler besides
  Triton's, CUDA only. They replace the forwards of the trainer's own modules only: what Liger
  also replaces in the modeling module, for the whole process, is put back (RoPE with it), and an
  engine's copy of the model runs the plain modules (weir.train.liger_scope). Its log-prob and loss
  kernels are not used: the trainer computes its own.
- `compile`: regional `torch.compile` of each decoder layer (as `Module.compile`: one compiled
  graph shared by all layers, the token dimension dynamic): any architecture, but Inductor needs a
  C compiler (and Triton on CUDA) and tens of seconds to compile at the first step. A forward
  carrying a KV cache (the `prefix` layout) runs the layers uncompiled (`_compile_layer` says why).

`auto` takes `compile` where it can run, else `liger` where it applies, on CUDA: on one H100
(2026-11-27, a compute copy) compiled layers trained the Qwen2.5-0.5B shape at 0.51-0.59 s a step
against 0.78-0.83 s for the old defaults (autocast, unfused), and on an H200 beat Liger's kernels
at both shapes (0.45 against 0.51 s at 0.5B, 1.13 against 1.21 s at 1.5B; docs/dev/gpu-runs.md).
`auto` fuses nothing on a CPU (compiling there took minutes, docs/dev/engine-speed.md), on an
FSDP2 rank and on a LoRA model (`_auto_holds_off`: not measured faster, or not checked on a GPU;
the one FSDP2 comparison, on an H100, ran its compiled layers uncompiled, see `_compile_layer`).
A route asked for that cannot run falls back to the next (`liger` -> `compile` -> `off`;
`compile` -> `off`), and the fallback and its reason are logged once. A peft (LoRA) model is fused
through its base model's modules.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from weir.algo.logprob_triton import c_compiler

log = logging.getLogger(__name__)

LIGER_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2")
"""`model_type`s whose Liger kernels compute what the Hugging Face modules compute (RMSNorm in
float32 cast back as Llama's does, SiLU-gated MLP)."""
COMPILE_OPTIONS: dict = {"dynamic": True}
"""`Module.compile`'s options for the `compile` route (tests swap in a counting backend)."""


@dataclass(frozen=True)
class Fusion:
    """The route `train.fuse` resolved to, and why."""

    route: str
    reason: str
    held: bool = False
    """`auto` chose to fuse nothing here (a CPU, an FSDP2 rank, a LoRA model): not a fallback."""


def _liger_refusal(model: torch.nn.Module, device: torch.device) -> str | None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if device.type != "cuda":
        return "Liger's kernels are Triton (CUDA only)"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install --no-deps liger-kernel)"
    if model_type not in LIGER_ARCHS:
        return f"Liger's kernels are not checked on {model_type!r} in weir"
    return None


def _compile_refusal(model: torch.nn.Module, device: torch.device) -> str | None:
    if c_compiler() is None:
        return "no C compiler on PATH ($CC, cc, gcc or clang) for Inductor and Triton"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if not _decoder_layers(model):
        return "no decoder layers found (model.model.layers)"
    return None


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (its LoRA layers sit inside its modules)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = getattr(_unwrapped(model), "model", None)
    base = getattr(base, "language_model", base)
    return list(getattr(base, "layers", None) or [])


def _auto_holds_off(model: torch.nn.Module) -> str | None:
    """Why `auto` fuses nothing on `model` although a route could run (None: it fuses). Measured
    or checked on a GPU so far: only a whole model in one process (docs/dev/gpu-runs.md)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return (
            "an FSDP2 rank (no route measured faster there yet); set train.fuse=liger or "
            "compile to use one"
        )
    if _unwrapped(model) is not model:
        return (
            "a LoRA (peft) model (no route checked on a GPU yet); set train.fuse=liger or compile"
        )
    return None


def choose_fusion(mode: str, model: torch.nn.Module, device: torch.device) -> Fusion:
    """Resolve `train.fuse` for `model` on `device` (see the module docstring)."""
    if mode == "off":
        return Fusion("off", "train.fuse=off")
    if mode == "auto" and device.type != "cuda":
        return Fusion("off", "a CPU: compiling the layers costs minutes, more than it saves", True)
    if mode == "auto" and (held := _auto_holds_off(model)) is not None:
        return Fusion("off", f"train.fuse=auto: {held}", True)
    order = {
        "auto": ["compile", "liger"],
        "liger": ["liger", "compile"],
        "compile": ["compile"],
    }
    reasons = []
    for route in order[mode]:
        check = _liger_refusal if route == "liger" else _compile_refusal
        refused = check(model, device)
        if refused is None:
            reason = f"train.fuse={mode}: {route}"
            return Fusion(route, "; ".join([*reasons, reason]))
        reasons.append(f"{route} off: {refused}")
    return Fusion("off", "; ".join(reasons))


def _compile_layer(layer: torch.nn.Module) -> None:
    """`layer.compile()`, except that a call carrying a KV cache runs uncompiled.

    A forward with a cache (the `prefix` layout's two passes and its start-up probe, an engine
    decoding on the trainer's modules) makes Dynamo guard on the state of the cache's entry for
    that layer's index, so each layer needs its own graph: the eighth recompile hits Dynamo's
    limit (`recompile_limit`, 8), and from then on every call that misses the graphs compiled so
    far runs uncompiled, the training forwards too when they come after the cache's (an FSDP2
    rank probes `prefix` at its first forward: its compiled training step ran eagerly). The calls
    without a cache (`varlen`, `padded`) share one graph. Set as `_compiled_call_impl`, as
    `Module.compile` does, so that a deep copy (the reference policy, an engine's copy), which
    drops it, runs uncompiled on its own weights (a compiled bound `forward` would run the
    original's)."""
    from transformers.cache_utils import Cache

    eager = layer._call_impl
    compiled = torch.compile(eager, **COMPILE_OPTIONS)

    def call(*args, **kwargs):
        cached = any(isinstance(a, Cache) for a in (*args, *kwargs.values()))
        return (eager if cached else compiled)(*args, **kwargs)

    layer._compiled_call_impl = call


def apply_fusion(
    mode: str, model: torch.nn.Module, device: torch.device, *, quiet: bool = False
) -> Fusion:
    """Apply `train.fuse` to `model` in place; the route taken is logged unless `quiet` (a
    fallback from what was asked for as a warning)."""
    fusion = choose_fusion(mode, model, device)
    if fusion.route == "liger":
        from weir.train.liger_scope import apply_liger

        apply_liger(_unwrapped(model))
    elif fusion.route == "compile":
        for layer in _decoder_layers(model):
            _compile_layer(layer)
    if quiet:
        return fusion
    asked_for_more = mode not in ("off", fusion.route) and not fusion.held
    (log.warning if asked_for_more else log.info)(
        "train.fuse: %s (%s)", fusion.route, fusion.reason
    )
    return fusion
