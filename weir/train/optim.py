"""AdamW (optionally with its state in CPU memory) and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def make_optimizer(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    offload: bool = False,
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; `offload` keeps its state on the CPU (OffloadedAdamW).

    Where every trainable parameter is a floating CUDA tensor (an FSDP2 DTensor whose shard is
    on CUDA counts), the fused kernel (`fused=True`: the whole update of all parameters in one
    pass, where foreach runs several multi-tensor kernels); elsewhere torch's default (foreach on
    CUDA, a loop on the CPU). Both compute the same update up to float rounding."""
    trainable = [p for p in params if p.requires_grad]
    if offload:
        return OffloadedAdamW(trainable, lr=lr, betas=betas, weight_decay=weight_decay)
    kwargs = {"fused": True} if fusable(trainable) else {}
    return torch.optim.AdamW(trainable, lr=lr, betas=betas, weight_decay=weight_decay, **kwargs)


def fusable(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch's fused AdamW takes `params`: all floating point, all on CUDA (a DTensor by
    its local shard: FSDP2 with CPU offload keeps shards on the host)."""

    def local(p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if hasattr(p, "to_local") else p

    return bool(params) and all(
        p.is_floating_point() and local(p).device.type == "cuda" for p in params
    )


class OffloadedAdamW(torch.optim.AdamW):
    """AdamW whose moments (8 bytes per parameter in float32) live in CPU memory.

    The model's parameters stay where they are (the GPU) and remain the master weights. Each step
    copies every parameter and its gradient to a CPU float32 copy, runs AdamW there, and copies
    the result back, so the device never holds optimizer state. Because the CPU copy is refreshed
    from the device before each step, weights loaded into the model from elsewhere (a checkpoint,
    a reference reset) are never overwritten by a stale copy. The update is the same as AdamW's on
    the device, up to float rounding of the copies (none for float32 parameters).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **kwargs) -> None:
        self._device_params = list(params)
        pin = torch.cuda.is_available()
        self._host = [
            torch.empty(p.shape, dtype=torch.float32, pin_memory=pin).requires_grad_(True)
            for p in self._device_params
        ]
        super().__init__(self._host, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step on the CPU copies; parameters without a gradient are left alone."""
        if closure is not None:
            raise ValueError("OffloadedAdamW.step does not take a closure")
        for dev, host in zip(self._device_params, self._host, strict=True):
            host.copy_(dev.detach())
            host.grad = None if dev.grad is None else dev.grad.detach().to("cpu", torch.float32)
        super().step()
        for dev, host in zip(self._device_params, self._host, strict=True):
            if host.grad is not None:
                dev.copy_(host, non_blocking=True)
        if any(p.is_cuda for p in self._device_params):
            torch.cuda.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for p in self._device_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def make_schedule(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    kind: str = "constant",
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """lr(t) = lr * t/warmup during warm-up, then 1 (constant) or
    min + (1 - min) * (1 + cos(pi * progress)) / 2 (cosine), progress from 0 to 1 after warm-up."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
