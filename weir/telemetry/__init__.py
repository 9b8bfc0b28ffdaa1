"""Metric sinks and console output."""

from weir.telemetry.sinks import ConsoleSink, JsonlSink, MetricsLogger, TensorBoardSink

__all__ = ["ConsoleSink", "JsonlSink", "MetricsLogger", "TensorBoardSink"]
