"""Run a program in a fresh interpreter: what a module imports is seen from nothing loaded, as a
Ray worker or a user's process starts."""

from __future__ import annotations

import subprocess
import sys


def printed_words(program: str) -> list[str]:
    """The words `program` (a `python -c` string) prints; a failing program fails the test."""
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    )
    return out.stdout.split()
