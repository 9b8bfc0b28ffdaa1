"""Inference engines: the `Engine` protocol and weir's built-in `TorchEngine`.

`TorchEngine` is imported when first used: a process that needs only a server's launcher (a Ray
actor owning a vLLM or SGLang server, `weir.engine.server_host`) does not load torch and
transformers.
"""

from __future__ import annotations

from typing import Any

from weir.engine.base import Completion, Engine, SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams", "TorchEngine"]


def __getattr__(name: str) -> Any:
    if name == "TorchEngine":
        from weir.engine.torch_engine import TorchEngine

        return TorchEngine
    raise AttributeError(f"module 'weir.engine' has no attribute {name!r}")
