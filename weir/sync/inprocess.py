"""The in-process transport: the engine copies the trainer's tensors directly (one process)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import torch

from weir.engine.base import Engine


def push_in_process(
    engine: Engine, named: Iterable[tuple[str, torch.Tensor]], version: int
) -> None:
    """Load `named` into `engine` between decode steps and stamp `version` (a tensor the engine
    already shares with the trainer is not copied)."""
    asyncio.run(engine.update_weights(named, version))
