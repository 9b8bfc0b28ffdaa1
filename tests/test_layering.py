"""Dependencies point one way (DESIGN.md): importing a package never pulls in the layers above it."""

from __future__ import annotations

import pytest

from tests.fresh_python import printed_words

# module -> weir packages it must not load (directly or through anything it imports)
ABOVE_ENGINE = {"train", "rollout", "loop", "serve", "cluster", "sync"}
RULES = {
    "weir.data.sources": {"engine", "train", "rollout", "loop", "serve", "cluster", "sync"},
    "weir.engine.torch_engine weir.engine.router weir.engine.ray_engine weir.engine.role_router": ABOVE_ENGINE,
    "weir.rollout.multi_turn weir.rollout.collect": {"train", "loop", "serve", "cluster", "sync"},
    "weir.serve": {"train", "loop", "cluster", "sync"},
    "weir.adapters weir.adapters.reasoning_gym weir.adapters.gymnasium weir.adapters.openenv "
    "weir.adapters.textarena weir.adapters.verifiers": {
        "train",
        "loop",
        "serve",
        "cluster",
        "sync",
    },
    "weir.buffer": {"engine", "train", "rollout", "loop", "serve", "cluster"},
    "weir.train.actor weir.train.role_trainer": {
        "engine",
        "rollout",
        "loop",
        "serve",
        "cluster",
        "sync",
    },
    "weir.sync.coordinator": {"loop", "rollout", "serve"},
    "weir.telemetry.report": {"engine", "train", "rollout", "loop", "serve", "cluster", "sync"},
    "weir.sandbox weir.sandbox.tool": {
        "config",
        "data",
        "engine",
        "train",
        "rollout",
        "loop",
        "serve",
        "cluster",
        "sync",
        "buffer",
        "tasks",
    },
}


@pytest.mark.parametrize("module", sorted(RULES))
def test_imports_point_one_way(module):
    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {module.split()!r}]; "
        "print(' '.join(sorted({k.split('.')[1] for k in sys.modules if k.startswith('weir.')})))"
    )
    loaded = set(printed_words(code))
    assert not loaded & RULES[module], f"{module} loads {sorted(loaded & RULES[module])}"
