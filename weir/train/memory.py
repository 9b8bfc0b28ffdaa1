"""Peak resident memory of this process over a stretch of code (Linux), for start-up and checkpoint
figures that a regression (e.g. a rank loading the whole model again) moves by a model's size.

Linux keeps the peak resident set size (``VmHWM`` in /proc/self/status) and resets it to the
current size when ``5`` is written to /proc/self/clear_refs. Elsewhere the functions return 0.
"""

from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return 0


def rss_bytes() -> int:
    """Resident set size now (0 where /proc is not there)."""
    return _status_bytes("VmRSS")


def reset_peak_rss() -> int:
    """Reset the peak-RSS mark to the current RSS; returns the current RSS (the baseline)."""
    try:
        _CLEAR.write_text("5")
    except OSError:
        return 0
    return rss_bytes()


def peak_rss_since(baseline: int) -> int:
    """How far the peak RSS rose above `baseline` (from `reset_peak_rss`) since the reset."""
    if baseline == 0:
        return 0
    return max(0, _status_bytes("VmHWM") - baseline)
