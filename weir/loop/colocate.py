"""Time-slicing one device between the engine and the trainer: the engine sleeps while it trains."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from weir.config import Config
from weir.engine import TorchEngine


@contextmanager
def engine_asleep(cfg: Config, engine: object, when: bool = True) -> Iterator[None]:
    """Within the block the built-in engine holds no KV cache (and, with
    engine.sleep_offload_weights, no weights when they are its own copy); it wakes on exit, also on
    error. Other engines (Ray replicas behind a router) are left as they are."""
    if not (when and cfg.engine.sleep_while_training and isinstance(engine, TorchEngine)):
        yield
        return
    own_copy = cfg.loop.mode == "async" or not cfg.engine.share_weights
    engine.sleep_sync(offload_weights=cfg.engine.sleep_offload_weights and own_copy)
    try:
        yield
    finally:
        engine.wake_sync()
