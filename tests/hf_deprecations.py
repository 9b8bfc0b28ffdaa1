"""A test fails when weir's own call into transformers raises a FutureWarning or DeprecationWarning.

A warnings filter cannot say this: transformers attributes a deprecated forward argument to the
frame that called the forward, which is torch's ``Module.__call__``, not weir. So `warnings.warn` is
wrapped while a test runs: a deprecation warned from inside transformers is traced back through
transformers' and torch's frames to the first frame outside them; when that frame is weir's, the
warning is recorded and the test fails (when it is peft's or the test's own, the call is not
weir's). The warning is still passed on to the ordinary machinery either way.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator

_DEPRECATIONS = (FutureWarning, DeprecationWarning)
_PASS_THROUGH = ("transformers", "torch")


def _package(frame) -> str:
    return str(frame.f_globals.get("__name__", "")).split(".", 1)[0]


def weir_caller(frame) -> str | None:
    """``file:line`` of the weir frame whose call led to a warning warned in `frame` (a frame of
    transformers), or None when the call did not come from weir."""
    if frame is None or _package(frame) != "transformers":
        return None
    while frame is not None and _package(frame) in _PASS_THROUGH:
        frame = frame.f_back
    if frame is None or _package(frame) != "weir":
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


@contextlib.contextmanager
def deprecations_from_weir() -> Iterator[list[str]]:
    """Within the block, record (``"<file:line>: <Category>: <message>"``) every transformers
    deprecation warning that weir's own calls raise, in any thread."""
    found: list[str] = []
    lock = threading.Lock()
    original = warnings.warn

    def warn(message, category=None, stacklevel=1, source=None, **kwargs):
        kind = type(message) if isinstance(message, Warning) else (category or UserWarning)
        if issubclass(kind, _DEPRECATIONS):
            where = weir_caller(sys._getframe(1))
            if where is not None:
                with lock:
                    found.append(f"{where}: {kind.__name__}: {message}")
        return original(message, category, stacklevel + 1, source, **kwargs)

    warnings.warn = warn
    try:
        yield found
    finally:
        warnings.warn = original
