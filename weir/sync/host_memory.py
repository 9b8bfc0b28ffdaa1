"""This process's resident memory, now and at its peak, to measure what a weight sync costs a rank.

Linux only: /proc/self/status gives VmRSS (resident now) and VmHWM (the high-water mark), and writing
"5" to /proc/self/clear_refs resets the high-water mark to the current RSS (Linux >= 4.0), so the
peak of one operation is `peak_rss()` after `reset_peak_rss()`. Elsewhere every value is 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_kib(key: str) -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss() -> int:
    """Resident set size now, bytes."""
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """Highest resident set size since the process started or since `reset_peak_rss`, bytes."""
    return _status_kib("VmHWM") * 1024


def trim() -> None:
    """Return the C heap's free memory to the OS (glibc; a no-op elsewhere)."""
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(name).malloc_trim(0)


def reset_peak_rss() -> bool:
    """Trim the heap and start a new peak at the current RSS; False where the kernel does not allow
    it."""
    trim()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
