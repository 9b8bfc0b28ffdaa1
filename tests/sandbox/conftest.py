"""Fixtures of the hostile-program suite (helpers in tests/sandbox/hostile.py)."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.sandbox.hostile import LEVELS_HERE, LIMITS
from weir.sandbox import Limits, Sandbox


@pytest.fixture(scope="module", params=LEVELS_HERE)
def level(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def sandboxes():
    """`make(level, guard=False, **limit overrides)`: one sandbox per configuration, closed (with
    its judge server) at the end of the module."""
    made: dict = {}

    def make(level: str, guard: bool = False, **overrides) -> Sandbox:
        key = (level, guard, tuple(sorted(overrides.items())))
        if key not in made:
            limits = Limits(**{**LIMITS.__dict__, **overrides})
            made[key] = Sandbox(limits, level=level, python_guard=guard)
        return made[key]

    yield make
    for sb in made.values():
        sb.close()


@pytest.fixture
def host_dir():
    """A directory on the host the sandbox's uids can traverse (planted files go here)."""
    d = tempfile.mkdtemp(prefix="weir-test-host-")
    os.chmod(d, 0o755)
    yield d
    for name in os.listdir(d):
        os.remove(os.path.join(d, name))
    os.rmdir(d)
