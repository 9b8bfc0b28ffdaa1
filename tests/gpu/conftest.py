"""GPU tests: marked `gpu`, skipped where torch sees no CUDA device (scripts/gpu_check.sh runs them)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(
        reason="needs a CUDA device (run scripts/gpu_check.sh on a GPU machine)"
    )
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
