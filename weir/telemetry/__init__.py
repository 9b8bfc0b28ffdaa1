"""Metric sinks, the live console, the timeline, rollout dumps and run reports."""

from weir.telemetry.sinks import (
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    TensorBoardSink,
    WandbSink,
    console_sink,
)

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "MetricsLogger",
    "TensorBoardSink",
    "WandbSink",
    "console_sink",
]
