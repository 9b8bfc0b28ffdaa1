"""Bounded-staleness buffer between asynchronous rollout producers and the trainer."""

from weir.buffer.buffer import BufferClosed, StalenessBuffer

__all__ = ["BufferClosed", "StalenessBuffer"]
