"""Supervised warm start: next-token cross-entropy on response tokens only, packed micro-batches."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch

from weir.config.schema import SFTConfig
from weir.data.vision import VisionInputs
from weir.train.optim import make_optimizer, make_schedule
from weir.train.packing import choose_layout, micro_batches, response_logprobs


def sft(
    model: torch.nn.Module,
    examples: list[tuple[list[int], list[int]] | tuple[list[int], list[int], VisionInputs]],
    cfg: SFTConfig,
    *,
    seed: int = 0,
    micro_batch_tokens: int = 8192,
    packing: str = "auto",
    on_step: Callable[[int, int, dict[str, Any]], None] | None = None,
) -> list[float]:
    """Train on (prompt_ids, response_ids) pairs, or (prompt_ids, response_ids, pixel inputs)
    for prompts with images; returns the loss of every optimizer step.

    loss = -(1/N) * sum over response tokens of log p(x_t | x_<t), N = response tokens in the batch.
    `packing` is `train.packing` (auto | packed | padded; see `weir.train.packing.choose_layout`).
    """
    if not examples:
        raise ValueError("SFT needs at least one (prompt, response) example")
    order = list(range(len(examples)))
    batches_per_epoch = (len(order) + cfg.batch_size - 1) // cfg.batch_size
    total = batches_per_epoch * cfg.epochs
    optimizer = make_optimizer(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = make_schedule(
        optimizer,
        warmup_steps=cfg.warmup_steps,
        total_steps=total,
        kind=cfg.schedule,
        min_lr_ratio=0.05,
    )
    layout = choose_layout(model, packing)
    rng = random.Random(seed)
    losses: list[float] = []
    step = 0
    for _ in range(cfg.epochs):
        rng.shuffle(order)
        for b in range(batches_per_epoch):
            t0 = time.perf_counter()
            chunk = order[b * cfg.batch_size : (b + 1) * cfg.batch_size]
            seqs = [examples[i][0] + examples[i][1] for i in chunk]
            lens = [len(examples[i][1]) for i in chunk]
            vis = [examples[i][2] if len(examples[i]) > 2 else None for i in chunk]
            n_tokens = float(sum(lens))
            optimizer.zero_grad(set_to_none=True)
            total_loss = 0.0
            for idx in micro_batches([len(s) for s in seqs], micro_batch_tokens, layout):
                out = response_logprobs(
                    model,
                    [seqs[i] for i in idx],
                    [lens[i] for i in idx],
                    layout=layout,
                    visions=[vis[i] for i in idx],
                )
                loss = -out.logprobs.sum() / n_tokens
                loss.backward()
                total_loss += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(total_loss)
            step += 1
            if on_step is not None:
                on_step(
                    step,
                    total,
                    {
                        "sft/loss": total_loss,
                        "sft/lr": schedule.get_last_lr()[0],
                        "time/step": time.perf_counter() - t0,
                    },
                )
    return losses
