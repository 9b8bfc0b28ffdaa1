"""Train and eval modes for RL: dropout off everywhere, activation checkpointing that takes effect.

RL needs deterministic log-probs, so the policy runs in eval mode; HF only checkpoints activations in
train mode, so with `train.gradient_checkpointing` the gradient forward switches to train mode with
every dropout probability at 0 (`grad_mode`), which computes exactly what eval mode computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from weir.data.moe_routing import checkpoint_context

__all__ = ["prepare_for_training", "grad_mode"]


def prepare_for_training(model: torch.nn.Module, *, checkpointing: bool) -> torch.nn.Module:
    """Eval mode (dropout off: RL needs deterministic log-probs); with `checkpointing`, activation
    checkpointing on and every dropout probability set to 0.

    HF only checkpoints activations in train mode, so the trainer's gradient forward runs in train
    mode (`grad_mode`); with every dropout at 0 (nn.Dropout modules and the attention modules'
    `attention_dropout`) train mode computes exactly what eval mode does. Outside that forward the
    model is in eval mode, so a colocated engine on the same module keeps its KV cache (HF drops
    `use_cache` while checkpointing in train mode).
    """
    if not checkpointing:
        return model.eval()
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"train.gradient_checkpointing: {type(model).__name__} does not support it; "
            "set train.gradient_checkpointing=false"
        )
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop"):
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    # context_fn: a recomputed MoE layer replays the routing its forward replayed (moe_routing)
    kwargs = {"use_reentrant": False, "context_fn": checkpoint_context}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # HF also hooks the input embeddings to make their output require grad, which only reentrant
    # checkpointing needs. The hook would follow the model into every engine built on it or on a
    # copy of it, and the built-in engine's direct decode forward (and its CUDA graphs) refuses a
    # hooked module: on an H100 a 0.5B-shaped engine copied after a checkpointed step decoded
    # about half as fast (benchmarks/gpu_step.py --compare-graphs, docs/gpu.md).
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()
    return model.eval()


@contextlib.contextmanager
def grad_mode(model: torch.nn.Module, checkpointing: bool) -> Iterator[None]:
    """Train mode for the enclosed gradient forward/backward when checkpointing, then eval again."""
    if not checkpointing:
        yield
        return
    model.train()
    try:
        yield
    finally:
        model.eval()
