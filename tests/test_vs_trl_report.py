"""benchmarks/vs_trl.py's verdict: each round's ratio is against the faster TRL side of that round
(`--trl-threads 1 2`), and a failed TRL run leaves the other as the baseline."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

PATH = Path(__file__).parents[1] / "benchmarks" / "vs_trl.py"


@pytest.fixture(scope="module")
def vs_trl():
    spec = importlib.util.spec_from_file_location("vs_trl_under_test", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    for name in ("trl_workloads", "vs_trl_sides"):
        sys.modules.pop(name, None)


def run(median: float, reward: float = 0.5) -> dict:
    """A run's result as a worker writes it: the warm-up step first, then steps at `median`."""
    return {
        "step_s": [9.0, median, median, median],
        "reward": [reward, reward + 0.1, reward - 0.1],
        "samples": [64.0],
        "episode": {
            k: 1.0
            for k in (
                "model_tokens",
                "prompt_tokens",
                "turns",
                "tool_calls",
                "tool_errors",
                "obs_tokens",
            )
        },
        "optimizer_updates": 3,
        "prompts_seen": ["p"],
    }


def test_each_round_is_against_its_faster_trl_side(vs_trl):
    results = {
        ("B", "trl"): [run(2.0), run(3.0), {"error": "trl exited 1"}],
        ("B", "trl-2t"): [run(2.5), run(2.4), run(4.0)],
        ("B", "weir-sync"): [run(1.0), run(1.25), run(1.6)],
    }
    sides = ["trl", "trl-2t"]
    picked = [vs_trl.fastest_trl(results, "B", sides, i)["step_s"][1] for i in range(3)]
    assert picked == [2.0, 2.4, 4.0]  # round 2: the one-thread run failed, two threads remain
    assert vs_trl.fastest_trl({("B", "trl"): [{"error": "x"}]}, "B", ["trl"], 0) is None


def test_verdict_prints_the_ratio_range_and_the_target(vs_trl, capsys):
    results = {
        ("B", "trl"): [run(2.0), run(3.0)],
        ("B", "trl-2t"): [run(2.5), run(2.4)],
        ("B", "weir-sync"): [run(1.0), run(1.25)],
    }
    args = SimpleNamespace(workloads=["B"], rounds=2, trl_python=sys.executable, trl_threads=[1, 2])
    vs_trl.report(results, args, ["trl", "trl-2t", "weir-sync"], ["trl", "trl-2t"], (1.0,) * 3)
    out = capsys.readouterr().out
    # round 0: 2.0 / 1.0; round 1: min(3.0, 2.4) / 1.25 = 1.92 -> not met
    assert "target: B weir-sync: 1.92-2.00x TRL's speed (target 2x, not met)" in out
    assert "| B | weir-sync | 1.00-1.25 | 1.92-2.00 | >= 2x: NOT MET |" in out
    assert "TRL 1/2, ratios against the faster" in out


def test_async_reward_is_also_set_beside_the_trl_step_of_the_same_policy(vs_trl, capsys):
    """An async step t+1 trains on samples of the policy TRL's step t samples (max_staleness 1):
    on a rising curve its reward per step trails by one step, and aligned it matches."""
    rising = [0.1, 0.2, 0.3, 0.4]
    trl, weir = run(2.0), run(0.5)
    trl["reward"], weir["reward"] = rising, [0.1, 0.1, 0.2, 0.3]  # the same curve, a step late
    (mine, mine_se), (theirs, theirs_se) = vs_trl.aligned([weir], [trl])
    assert mine == pytest.approx(0.2) and theirs == pytest.approx(0.2)  # steps 2-4 vs 1-3
    assert mine_se == pytest.approx(theirs_se) == pytest.approx(0.1 / 3**0.5)

    results = {("A", "trl"): [trl], ("A", "weir-async"): [weir]}
    args = SimpleNamespace(workloads=["A"], rounds=1, trl_python=sys.executable, trl_threads=[1])
    vs_trl.report(results, args, ["trl", "weir-async"], ["trl"], (1.0,) * 3)
    out = capsys.readouterr().out
    # over all steps 0.175 against 0.25; by policy version 0.200 against 0.200
    assert "reward/step 0.175 +- 0.048 vs TRL 0.250 +- 0.065" in out
    assert "of the same policy) 0.200 +- 0.058 vs 0.200 +- 0.058: equal within 2 s.e." in out
