"""Synchronous against asynchronous training on this machine: trained samples/s per thread split.

Same workload, model, warm start and sample budget for every mode. Modes: sync with 1 and with 2
torch threads, and async (disaggregated: engine and trainer in their own threads) for each split
of ``loop.engine_threads`` / ``loop.trainer_threads`` given by ``--splits``. Throughput is trained
samples per second over the steps after the first (warm-up, and in async the first batch the trainer
waits for, excluded), from the runs' own step times; ``--repeats`` alternating runs per mode.

Workloads:

- ``arithmetic``: examples/arithmetic_quick.yaml (1-digit addition, ~4-token answers), 32 x 8;
- ``B``: 8 prompts x n=8 = 64 samples x 128 generated tokens: the tiny model before SFT, which
  almost never emits its end token, so every sample runs to max_new_tokens;
- ``calculator``: examples/calculator.yaml, the tool-using agent (multi-turn), 16 x 8, from an
  SFT'd calculator model (``--model``, or one is trained first).

    python benchmarks/async_vs_sync.py --workload B --steps 6
    python benchmarks/async_vs_sync.py --workload calculator --model runs/calc_sft/model
    python benchmarks/async_vs_sync.py --splits 1:1 1:2 2:1 --reward-latency 0.02
    python benchmarks/async_vs_sync.py --workload B --splits 1:1 --in-flight recompute keep finish
    python benchmarks/async_vs_sync.py --workload calculator --splits 1:1 --engine thread process
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from pathlib import Path

import weir
from weir.rollout.rewards import exact_match

EXAMPLES = Path(__file__).parents[1] / "examples"
# --in-flight: what the async runs do with responses in flight at a weight update
IN_FLIGHT = {
    "recompute": ("", ["engine.kv_on_update=recompute"]),
    "keep": (", keep KV", ["engine.kv_on_update=keep"]),
    "finish": (", finish", ["loop.on_weight_update=finish"]),
}
QUIET = ["telemetry.console=false", "run.save_model=false", "data.eval_size=16"]
WORKLOADS = {
    "arithmetic": (
        "arithmetic_quick.yaml",
        ["rollout.max_new_tokens=4"],
        True,
    ),
    "B": (
        "arithmetic_quick.yaml",
        ["rollout.batch_prompts=8", "rollout.n=8", "rollout.max_new_tokens=128"],
        False,
    ),
    "calculator": ("calculator.yaml", [], True),
}


def slow_exact_match(sample, row, *, latency: float) -> float:
    """exact_match behind a fixed latency, like a sandbox or a remote verifier."""
    time.sleep(latency)
    return exact_match(sample, row)


def throughput(history: list[dict]) -> tuple[float, float, float]:
    """(trained samples/s over steps 2.., mean reward of the last 3 steps, mean train s/step)."""
    steps = [h for h in history if "batch/samples" in h]
    later = steps[1:] or steps
    seconds = sum(h["time/step"] for h in later)
    samples = sum(h["batch/samples"] for h in later)
    reward = statistics.mean(h["reward/mean"] for h in steps[-3:])
    train = statistics.mean(h["time/train"] for h in later)
    return samples / seconds, reward, train


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="arithmetic")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--eta", type=int, default=1, help="loop.max_staleness of the async runs")
    ap.add_argument(
        "--splits",
        nargs="+",
        default=["1:1", "1:2", "2:1"],
        help="async thread splits engine:trainer",
    )
    ap.add_argument(
        "--in-flight",
        nargs="+",
        default=["recompute"],
        choices=sorted(IN_FLIGHT),
        help="what async does with responses in flight at a weight update (each split runs once "
        "per value): recompute their KV (the default), keep it (engine.kv_on_update=keep), or "
        "finish them under the old weights first (loop.on_weight_update=finish)",
    )
    ap.add_argument(
        "--engine",
        nargs="+",
        default=["thread"],
        choices=["thread", "process"],
        help="where the async runs' engine runs (each split runs once per value): a thread of the "
        "trainer's process, or a child process (engine.process=true)",
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--model", help="warm-start model (default: SFT one now, if the workload has one)"
    )
    ap.add_argument(
        "--reward-latency", type=float, default=0.0, help="seconds each reward call sleeps"
    )
    args = ap.parse_args()
    config, extra, warm_start = WORKLOADS[args.workload]
    base = str(EXAMPLES / config)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model
        if model is None and warm_start:
            model = str(weir.sft(base, [*QUIET, f"run.dir={root / 'sft'}"]))
        common = [*QUIET, *extra, f"run.steps={args.steps}", f"run.eval_every={10 * args.steps}"]
        if model is not None:
            common.append(f"model.path={model}")
        modes = [
            ("sync, 1 thread", ["loop.mode=sync", "model.threads=1"]),
            ("sync, 2 threads", ["loop.mode=sync", "model.threads=2"]),
        ]
        for split in args.splits:
            e, t = split.split(":")
            for how in args.in_flight:
                label, overrides = IN_FLIGHT[how]
                for where in args.engine:
                    modes.append(
                        (
                            f"async {e}+{t} thr{label}"
                            + (", process" if where == "process" else ""),
                            [
                                "loop.mode=async",
                                f"loop.max_staleness={args.eta}",
                                f"loop.engine_threads={e}",
                                f"loop.trainer_threads={t}",
                                f"model.threads={t}",
                                f"engine.process={where == 'process'}",
                                *overrides,
                            ],
                        )
                    )
        reward = (
            functools.partial(slow_exact_match, latency=args.reward_latency)
            if args.reward_latency
            else None
        )
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in modes}
        loads = []
        for rep in range(args.repeats):
            for name, mode in modes:
                run_dir = root / f"{name.replace(' ', '_').replace(',', '')}_{rep}"
                loads.append(os.getloadavg()[0])
                result = weir.run(base, [*common, *mode, f"run.dir={run_dir}"], reward=reward)
                results[name].append(throughput(result.history))
                loads.append(os.getloadavg()[0])
    print(
        f"workload {args.workload}: {config} {' '.join(extra)}; {args.steps} steps, async eta "
        f"{args.eta}, reward latency {args.reward_latency * 1000:.0f} ms; {args.repeats} "
        f"alternating run(s) per mode; {os.cpu_count()} cores, load average "
        f"{min(loads):.1f}-{max(loads):.1f} during the runs"
    )
    base_sps = max(
        statistics.median(r[0] for r in results[name]) for name, _ in modes[:2]
    )  # the faster sync mode
    print(
        f"{'mode':<36}{'samples/s':>10}{'range':>15}{'vs best sync':>14}{'reward':>8}{'train s':>9}"
    )
    for name, _ in modes:
        rs = results[name]
        sps = [r[0] for r in rs]
        med = statistics.median(sps)
        print(
            f"{name:<36}{med:>10.2f}{f'{min(sps):.2f}-{max(sps):.2f}':>15}{med / base_sps:>14.2f}"
            f"{statistics.median(r[1] for r in rs):>8.3f}{statistics.median(r[2] for r in rs):>9.2f}"
        )


if __name__ == "__main__":
    main()
