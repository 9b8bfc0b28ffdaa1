"""The drivers: `run_sync` (and, later, `run_async`)."""

from weir.loop.sync import RunResult, run_sync

__all__ = ["RunResult", "run_sync"]
