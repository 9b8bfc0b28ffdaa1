"""Run untrusted programs (a policy's code) with limits and isolation; see docs/code.md.

`Sandbox` runs programs; `default_sandbox()` is the process-wide one rewards and the `python` tool use,
set from the `sandbox` config section by `configure`.
"""

from __future__ import annotations

import threading
from typing import Any

from weir.sandbox.isolation import LEVELS, Isolation, detect
from weir.sandbox.limits import STATUSES, ExecResult, Limits, TestOutcome
from weir.sandbox.sandbox import Sandbox

__all__ = [
    "LEVELS",
    "STATUSES",
    "ExecResult",
    "Isolation",
    "Limits",
    "Sandbox",
    "TestOutcome",
    "configure",
    "default_sandbox",
    "detect",
]

_DEFAULT: Sandbox | None = None
_LOCK = threading.Lock()


def configure(section: Any) -> Sandbox:
    """Make the sandbox of the `sandbox` config section the process-wide default, and return it.

    A named level is checked now, so a level that cannot run here stops the run at its start;
    ``auto`` is detected on first use (a run without code never starts a sandbox)."""
    global _DEFAULT
    sandbox = Sandbox.from_config(section)
    if section.level != "auto":
        sandbox.isolation  # noqa: B018
    with _LOCK:
        old, _DEFAULT = _DEFAULT, sandbox
    if old is not None:
        old.close()
    return sandbox


def default_sandbox() -> Sandbox:
    """The process-wide sandbox (default limits and level until `configure` sets one)."""
    global _DEFAULT
    with _LOCK:
        if _DEFAULT is None:
            _DEFAULT = Sandbox()
        return _DEFAULT
