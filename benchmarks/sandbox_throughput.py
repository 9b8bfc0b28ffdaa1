"""Sandbox throughput: executions per second of a small program at each isolation level that works here.

    .venv/bin/python benchmarks/sandbox_throughput.py --executions 200 --parallel 2 4 --repeats 3
    .venv/bin/python benchmarks/sandbox_throughput.py --baseline /tmp/old  # old tree vs this one

Each execution is one HumanEval-sized harness run (a function and three asserts, judged in a
process apart from the program); the figure is executions / wall-clock seconds with `parallel`
slots, min-max over `repeats` runs. With ``--baseline DIR`` (a source tree holding another version
of the ``weir`` package, e.g. ``git archive <commit> weir | tar -x -C DIR``) each run measures that
version and this one back to back, in fresh processes, alternating which goes first, and prints
the ratio of their medians (this / baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROGRAM = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]
LEVELS = ("bwrap", "namespaces", "rlimit")
REPO = Path(__file__).resolve().parent.parent


def measure(level: str, parallel: int, executions: int) -> float:
    from weir.sandbox import Limits, Sandbox

    sb = Sandbox(Limits(wall_s=30, cpu_s=10), level=level, max_parallel=parallel)
    sb.isolation  # noqa: B018  (detected before the clock starts)

    async def main():
        return await asyncio.gather(*(sb.arun(PROGRAM, tests=TESTS) for _ in range(executions)))

    t0 = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    sb.close()
    assert all(r.passed == len(TESTS) for r in results), {(r.status, r.reason) for r in results}
    return executions / elapsed


def _in_subprocess(tree: Path, level: str, parallel: int, executions: int) -> float:
    """One measurement with the ``weir`` package of `tree`, in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, __file__, "--worker", level, str(parallel), str(executions)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def _available(level: str) -> bool:
    from weir.sandbox import Sandbox

    try:
        Sandbox(level=level).isolation  # noqa: B018
    except ValueError as e:
        print(f"{level}: not available ({e})")
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--executions", type=int, default=200)
    ap.add_argument("--parallel", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--levels", nargs="+", default=list(LEVELS))
    ap.add_argument("--baseline", type=Path, help="a source tree with another weir to compare")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        level, parallel, executions = args.worker
        print(measure(level, int(parallel), int(executions)))
        return
    out = {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0], "results": []}
    for level in filter(_available, args.levels):
        for parallel in args.parallel:
            row: dict = {"level": level, "parallel": parallel}
            if args.baseline is None:
                row["per_s"] = [
                    measure(level, parallel, args.executions) for _ in range(args.repeats)
                ]
                rates = row["per_s"]
                print(
                    f"{level:10} parallel={parallel}: {min(rates):.1f}-{max(rates):.1f} executions/s"
                )
            else:
                new, old = [], []
                for i in range(args.repeats):
                    order = [(REPO, new), (args.baseline, old)]
                    for tree, into in order if i % 2 == 0 else order[::-1]:
                        into.append(_in_subprocess(tree, level, parallel, args.executions))
                row.update(per_s=new, baseline_per_s=old)
                row["ratio"] = statistics.median(new) / statistics.median(old)
                print(
                    f"{level:10} parallel={parallel}: {min(new):.1f}-{max(new):.1f} executions/s, "
                    f"baseline {min(old):.1f}-{max(old):.1f}, ratio {row['ratio']:.2f}"
                )
            out["results"].append(row)
    out["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
