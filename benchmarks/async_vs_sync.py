"""Synchronous against asynchronous training on this machine: trained samples/s and reward.

Same task, model, warm start and sample budget for every mode; one run, so the ratios compare
like with like on a shared machine.

    python benchmarks/async_vs_sync.py                 # 1-digit addition, 20 steps of 32 x 8
    python benchmarks/async_vs_sync.py --reward-latency 0.02   # a verifier taking 20 ms a call
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

import weir
from weir.rollout.rewards import exact_match


def slow_exact_match(sample, row, *, latency: float) -> float:
    """exact_match behind a fixed latency, like a sandbox or a remote verifier."""
    time.sleep(latency)
    return exact_match(sample, row)


BASE = str(Path(__file__).parents[1] / "examples" / "arithmetic_quick.yaml")
QUIET = ["telemetry.console=false", "run.save_model=false"]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--etas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument(
        "--reward-latency", type=float, default=0.0, help="seconds each reward call sleeps"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sft_model = weir.sft(BASE, [*QUIET, f"run.dir={root / 'sft'}"])
        common = [
            *QUIET,
            f"model.path={sft_model}",
            f"run.steps={args.steps}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
        ]
        modes = [
            ("sync, 1 thread", ["loop.mode=sync", "model.threads=1"]),
            ("sync, 2 threads", ["loop.mode=sync", "model.threads=2"]),
        ]
        modes += [
            (f"async eta={e}", ["loop.mode=async", f"loop.max_staleness={e}"]) for e in args.etas
        ]
        rows = []
        for name, extra in modes:
            start = time.perf_counter()
            reward = (
                functools.partial(slow_exact_match, latency=args.reward_latency)
                if args.reward_latency
                else None
            )
            result = weir.run(
                BASE, [*common, *extra, f"run.dir={root / name.replace(' ', '_')}"], reward=reward
            )
            seconds = time.perf_counter() - start
            steps = [h for h in result.history if "reward/mean" in h]
            samples = sum(h["batch/samples"] for h in steps)
            train_s = sum(h["time/train"] for h in steps)
            rows.append(
                (
                    name,
                    samples / seconds,
                    sum(h["reward/mean"] for h in steps[-5:]) / 5,
                    result.evals[-1]["eval/accuracy"],
                    seconds,
                    train_s,
                    max(h.get("staleness/max", 0) for h in steps),
                )
            )
    base = rows[0][1]
    print(
        f"{args.steps} steps x 32 prompts x n=8 (examples/arithmetic_quick.yaml), "
        f"reward latency {args.reward_latency * 1000:.0f} ms"
    )
    print(
        f"{'mode':<18}{'samples/s':>10}{'ratio':>7}{'reward(last5)':>15}{'eval acc':>10}{'wall s':>8}{'train s':>9}{'max stale':>10}"
    )
    for name, sps, rew, acc, sec, tr, st in rows:
        print(
            f"{name:<18}{sps:>10.1f}{sps / base:>7.2f}{rew:>15.3f}{acc:>10.3f}{sec:>8.1f}{tr:>9.1f}{st:>10.0f}"
        )


if __name__ == "__main__":
    main()
