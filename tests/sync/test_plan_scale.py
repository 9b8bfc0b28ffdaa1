"""The planning model (benchmarks/plan_scale.py) computes what its docstring says, checked by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).parents[2] / "benchmarks" / "plan_scale.py"


@pytest.fixture(scope="module")
def plan_scale():
    spec = importlib.util.spec_from_file_location("plan_scale", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_scale"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["plan_scale"]


def test_sync_checkpoint_and_trainer_memory_follow_the_stated_formulas(plan_scale):
    w = plan_scale.Workload()
    p = 7.62e9
    inside = plan_scale.plan("7B", 8, w)  # one node: NVLink at 70% of 450 GB/s
    buckets = 2 * p / (64 * 2**20)
    want = 2 * p * 7 / 8 / 315e9 + 2 * p / 315e9 + buckets * 200e-6
    assert inside.sync_s == pytest.approx(want, rel=1e-9)
    assert inside.sync_s == pytest.approx(0.136, abs=0.001)  # 0.042 + 0.048 + 227 x 200 us
    across = plan_scale.plan("7B", 64, w)  # eight nodes: one NIC at 80% of 50 GB/s
    assert across.sync_s == pytest.approx(2 * p * 63 / 64 / 40e9 + 2 * p / 40e9 + buckets * 2e-4)
    # 16 bytes per parameter written at 5 GB/s per node
    assert inside.checkpoint_s == pytest.approx(16 * p / 5e9)
    assert across.checkpoint_s == pytest.approx(16 * p / (8 * 5e9))
    # the trainer's state alone is 16 P / G; the rest (layers, activations, logits) is small here
    assert 16 * p / 8 / 1e9 < inside.trainer_gb < 16 * p / 8 / 1e9 + 8


def test_more_gpus_never_slow_training_and_32b_on_8_does_not_fit(plan_scale):
    w = plan_scale.Workload()
    trains = [plan_scale.plan("32B", g, w).train_s for g in (8, 16, 32, 64)]
    assert trains == sorted(trains, reverse=True)
    assert trains[0] == pytest.approx(8 * trains[3])  # compute-bound: linear in the GPU count
    assert not plan_scale.plan("32B", 8, w).fits_colocated
    assert plan_scale.plan("32B", 16, w).fits_colocated
