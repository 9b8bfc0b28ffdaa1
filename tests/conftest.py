from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)  # tiny models: 1 thread is as fast, and immune to oversubscription


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen3 model directory with weir's tokenizer, built once per test session."""
    from weir.tasks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)
