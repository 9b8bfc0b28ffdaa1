"""Activation checkpointing and the micro-batch token budget from a memory model
(`train.memory: plan`), instead of fixed `train.gradient_checkpointing` and
`train.micro_batch_tokens`.

What a training micro-batch of T tokens holds on the device, beyond the model's own state:

    activations(T) = T * layers * per_layer + T * head          (no checkpointing)
    activations(T) = T * layers * d * p + T * layers_1 + T * head  (checkpointing: each layer keeps
                                                                    its input; one layer's whole
                                                                    activations during recompute)

with, per token of a Llama-family decoder layer (d hidden, f MLP width, H_q / H_kv heads of d_h,
p the parameter dtype's bytes, c the compute dtype's, r the residual stream's: under autocast the
residual stream and the RMSNorms stay in the parameter dtype (r = p) and each linear saves its own
cast of its input; on a compute copy (`train.mixed_precision: compute_copy`) they are in the
compute dtype (r = c) and nothing is cast):

    per_layer = 6 d r                  two RMSNorms (normalised input and output) and two residuals
              + 5 d c                  the casts of the norms' outputs for q, k, v, gate, up (autocast)
              + (H_q + 2 H_kv) d_h c   q, k (after RoPE) and v, saved by attention
              + 2 H_q d_h c            attention's output and its contiguous copy for o_proj
              + 4 f c                  gate, SiLU(gate), up, SiLU(gate) * up
              + 2 (H_q + H_kv) d_h r   with QK-norm (Qwen3, OLMo 2): its input and output

and `head` = 2 V c per response row (the logits and their gradient; one row per token at worst).
The model's state is 4 + 4 + 8 bytes per parameter in float32 (weights, gradients, AdamW's two
moments) plus c per parameter for the compute-dtype weight copies (autocast's cache during a
forward, or the compute copy during a step).
`plan` turns checkpointing off when the configured budget's activations fit in the free memory with
a margin, and sizes the budget to the largest power of two that fits (checked against allocations
counted on a CPU by tests/train/test_memory_plan.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MARGIN = 0.8
"""Share of the free memory the plan fills (the rest: allocator fragmentation, kernels' scratch)."""
BUDGETS = (4096, 8192, 16384, 32768, 65536)


@dataclass(frozen=True)
class MemoryModel:
    """Bytes a training micro-batch holds per token, and the model's own state."""

    per_layer: float
    layers: int
    hidden: int
    head: float
    state: float
    residual_bytes: int

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        param_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        *,
        copy: bool = False,
    ) -> MemoryModel:
        """The model for `model` computing in `compute_dtype` on `param_dtype` weights, under
        autocast or (`copy`) on a compute-dtype copy of them."""
        cfg = model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        d, f = int(cfg.hidden_size), int(cfg.intermediate_size)
        hq = int(cfg.num_attention_heads)
        hkv = int(getattr(cfg, "num_key_value_heads", None) or hq)
        hd = int(getattr(cfg, "head_dim", None) or d // hq)
        p = torch.finfo(param_dtype).bits // 8
        c = torch.finfo(compute_dtype).bits // 8
        mixed = compute_dtype != param_dtype
        cast = c if mixed and not copy else 0
        r = c if copy else p
        per_layer = 6 * d * r + 5 * d * cast + (hq + 2 * hkv) * hd * c + 2 * hq * hd * c + 4 * f * c
        if _has_qk_norm(model):  # Qwen3, OLMo 2: RMSNorms of q and k, in the residual's dtype
            per_layer += 2 * (hq + hkv) * hd * r
        vocab = int(model.get_output_embeddings().weight.shape[0])
        n = sum(q.numel() for q in model.parameters())
        return cls(
            per_layer=per_layer,
            layers=int(cfg.num_hidden_layers),
            hidden=d,
            head=2 * vocab * c,
            state=n * (16 + (c if mixed else 0)),
            residual_bytes=r,
        )

    def activations(self, tokens: int, checkpointing: bool) -> float:
        """Bytes a micro-batch of `tokens` holds at its peak (its backward's start)."""
        if checkpointing:
            body = tokens * (self.layers * self.hidden * self.residual_bytes + self.per_layer)
        else:
            body = tokens * self.layers * self.per_layer
        return body + tokens * self.head


def _has_qk_norm(model: torch.nn.Module) -> bool:
    base = getattr(model, "model", None)
    layers = getattr(getattr(base, "language_model", base), "layers", None) or []
    attn = getattr(layers[0], "self_attn", None) if len(layers) else None
    return attn is not None and hasattr(attn, "q_norm")


@dataclass(frozen=True)
class MemoryPlan:
    checkpointing: bool
    micro_batch_tokens: int
    reason: str


def plan(model_memory: MemoryModel, free_bytes: float, budget: int) -> MemoryPlan:
    """Checkpointing off where the configured `budget` fits without it, and the largest budget of
    `BUDGETS` (at least the configured one's half) that fits either way."""
    room = free_bytes * MARGIN - model_memory.state
    gib = 2**30
    for checkpointing in (False, True):
        fits = [b for b in BUDGETS if model_memory.activations(b, checkpointing) <= room]
        if fits and max(fits) >= budget // 2:
            best = max(fits)
            need = model_memory.activations(best, checkpointing) / gib
            return MemoryPlan(
                checkpointing,
                best,
                f"{best} tokens need {need:.1f} GiB of activations "
                f"{'with' if checkpointing else 'without'} checkpointing; "
                f"{max(room, 0) / gib:.1f} GiB free after the model's state",
            )
    return MemoryPlan(
        True,
        min(BUDGETS),
        f"even {min(BUDGETS)} tokens with checkpointing need "
        f"{model_memory.activations(min(BUDGETS), True) / gib:.1f} GiB; "
        f"{max(room, 0) / gib:.1f} GiB free after the model's state",
    )


def planned_train_config(train, model: torch.nn.Module, device: torch.device, precision):
    """`train` with `gradient_checkpointing` and `micro_batch_tokens` from `plan` when
    `train.memory` is `plan` and the device is a GPU (its free memory is known); else `train`."""
    if getattr(train, "memory", "fixed") != "plan":
        return train
    if device.type != "cuda":
        log.info("train.memory=plan: not on a GPU; the configured budget and checkpointing stay")
        return train
    free, _ = torch.cuda.mem_get_info(device)
    mm = MemoryModel.for_model(
        model,
        precision.param_dtype,
        precision.compute_dtype,
        copy=precision.mixed and precision.copy,
    )
    chosen = plan(mm, free, train.micro_batch_tokens)
    log.info(
        "train.memory=plan: gradient_checkpointing=%s, micro_batch_tokens=%d (%s)",
        chosen.checkpointing,
        chosen.micro_batch_tokens,
        chosen.reason,
    )
    return train.model_copy(
        update={
            "gradient_checkpointing": chosen.checkpointing,
            "micro_batch_tokens": chosen.micro_batch_tokens,
        }
    )
