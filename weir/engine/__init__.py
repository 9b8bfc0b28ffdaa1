"""Inference engines: the `Engine` protocol and weir's built-in `TorchEngine`."""

from weir.engine.base import Completion, Engine, SamplingParams
from weir.engine.torch_engine import TorchEngine

__all__ = ["Completion", "Engine", "SamplingParams", "TorchEngine"]
