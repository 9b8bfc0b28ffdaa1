"""Fixtures for the engine tests: a tiny model built once, fresh copies per test, and references
computed with plain full-sequence forward passes."""

from __future__ import annotations

import copy

import pytest
from engine_helpers import EOS, PAD
from transformers import AutoModelForCausalLM

from weir.engine import TorchEngine
from weir.tasks.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def engine_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("engine_models") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def base_model(engine_model_dir):
    return AutoModelForCausalLM.from_pretrained(engine_model_dir).eval()


@pytest.fixture
def model(base_model):
    """A private copy (tests may change its weights)."""
    return copy.deepcopy(base_model)


@pytest.fixture
def make_engine(model):
    engines = []

    def make(m=None, **kw):
        kw.setdefault("eos_token_ids", [EOS])
        kw.setdefault("pad_token_id", PAD)
        eng = TorchEngine(m if m is not None else model, **kw)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


@pytest.fixture
def engine(make_engine):
    return make_engine()
