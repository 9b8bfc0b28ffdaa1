"""How long a Ray run takes to start: trainer ranks, engine replicas and reward workers.

A Ray run starts the three groups side by side (weir.loop.ray_build: each is a process that
imports torch and loads its model or its reward's module, and none needs another before the
weight sync is connected). This script times `build` (from the config to the first rollout's
readiness: the driver's meta model, the actors, the weight sync) that way and with the groups
started one after another (trainer ranks, then engines, then reward workers: weir's order until
2026-11-29, recreated here by patching), alternating the two, on one local Ray started once.

The reward is a module's function; `--reward-imports torch` makes that module import torch, as
a reward that scores with a model or tensors does.

    python benchmarks/ray_start.py                      # 3 rounds, 2 ranks, 1 replica, 2 workers
    python benchmarks/ray_start.py --rounds 5 --ranks 1 --reward-imports torch
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

REWARD_MODULE = "weir_bench_reward"


def write_reward_module(root: Path, imports: str) -> str:
    """A reward module of the user's kind in `root` (on the workers' import path); its dotted path."""
    head = f"import {imports}\n\n" if imports else ""
    (root / f"{REWARD_MODULE}.py").write_text(
        head + "def reward(sample, row):\n    return float(len(sample.response_ids) % 2)\n"
    )
    return f"{REWARD_MODULE}:reward"


class LatePool:
    """A reward pool that starts its workers only when it is waited for (the order before)."""

    def __init__(self, fn, workers: int, **_: object) -> None:
        self.fn, self.workers, self.pool = fn, workers, None

    def wait_started(self) -> None:
        from weir.cluster.rewards import RewardPool

        self.pool = RewardPool(self.fn, workers=self.workers)
        self.reward = self.pool.reward

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


@contextlib.contextmanager
def one_after_another():
    import weir.loop.ray_build as ray_build

    saved = ray_build._start_together, ray_build.RewardPool
    ray_build._start_together, ray_build.RewardPool = ray_build._start_in_turn, LatePool
    try:
        yield
    finally:
        ray_build._start_together, ray_build.RewardPool = saved


def time_build(cfg, run_dir: Path) -> float:
    from weir.loop.components import build

    start = time.perf_counter()
    parts = build(cfg, run_dir)
    took = time.perf_counter() - start
    parts.cluster.shutdown()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--reward-workers", type=int, default=2)
    ap.add_argument("--reward-imports", default="", help="a module the reward's module imports")
    ap.add_argument("--model", default="tiny:nano")
    args = ap.parse_args()

    import ray

    from weir.cluster.ray_cluster import driver_env
    from weir.config import build_config

    root = Path(tempfile.mkdtemp(prefix="weir-ray-start-"))
    sys.path.insert(0, str(root))  # driver_env() hands the driver's path to the workers
    reward = write_reward_module(root, args.reward_imports)
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env=driver_env())
    cfg = build_config(
        {
            "run": {"steps": 0, "eval_every": 0},
            "model": {"path": args.model, "threads": 1},
            "data": {"task": "arithmetic", "eval_size": 4},
            "reward": {"function": reward},
            "telemetry": {"console": False},
        },
        [
            "cluster.type=ray",
            f"cluster.trainer.ranks={args.ranks}",
            f"cluster.engines.replicas={args.replicas}",
            "cluster.trainer.cpus_per_rank=0.5",
            "cluster.engines.cpus=0.5",
            f"cluster.reward_workers={args.reward_workers}",
        ],
    )
    time_build(cfg, root / "warm-up")  # the tiny model built, the files in the page cache
    times: dict[str, list[float]] = {"side by side": [], "one after another": []}
    for r in range(args.rounds):
        order = list(times) if r % 2 == 0 else list(reversed(times))
        for name in order:
            with one_after_another() if name == "one after another" else contextlib.nullcontext():
                took = time_build(cfg, root / f"{name.replace(' ', '-')}-{r}")
            times[name].append(took)
            print(f"round {r}: {name:<17} {took:6.1f} s", flush=True)
    ray.shutdown()
    print(
        f"\n{args.ranks} trainer ranks, {args.replicas} engine replicas, {args.reward_workers} "
        f"reward workers (the reward's module imports {args.reward_imports or 'nothing'}), "
        f"model {args.model}, {args.rounds} rounds"
    )
    for name, ts in times.items():
        print(
            f"{name:<17} median {statistics.median(ts):6.1f} s  range {min(ts):.1f}-{max(ts):.1f}"
        )
    ratio = statistics.median(times["side by side"]) / statistics.median(times["one after another"])
    print(f"side by side / one after another: {ratio:.2f}")


if __name__ == "__main__":
    main()
