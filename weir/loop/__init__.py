"""The drivers: `run_sync`, `run_async`, and `train`, which picks one by `loop.mode`."""

from __future__ import annotations

from collections.abc import Callable

from weir.config import Config
from weir.loop.sync import RunResult, run_sync


def train(cfg: Config, **plugins: Callable | None) -> RunResult:
    """Run the loop `cfg.loop.mode` names (sync or async) with the given plugins."""
    if cfg.loop.mode == "async":
        from weir.loop.async_loop import run_async

        return run_async(cfg, **plugins)
    return run_sync(cfg, **plugins)


__all__ = ["RunResult", "run_sync", "train"]
