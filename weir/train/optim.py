"""AdamW with linear warm-up followed by a constant or cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch


def make_optimizer(
    params, *, lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad], lr=lr, betas=betas, weight_decay=weight_decay
    )


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
