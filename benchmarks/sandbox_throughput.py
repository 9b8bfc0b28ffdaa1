"""Sandbox throughput: executions per second of a small program at each isolation level that works here.

    .venv/bin/python benchmarks/sandbox_throughput.py --executions 200 --parallel 2 4 --repeats 3

Each execution is one HumanEval-sized harness run (a function and three asserts); the figure is
executions / wall-clock seconds with `parallel` slots, min-max over `repeats` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from weir.sandbox import LEVELS, Limits, Sandbox

PROGRAM = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]


def measure(level: str, parallel: int, executions: int) -> float:
    sb = Sandbox(Limits(wall_s=30, cpu_s=10), level=level, max_parallel=parallel)

    async def main():
        return await asyncio.gather(*(sb.arun(PROGRAM, tests=TESTS) for _ in range(executions)))

    t0 = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    sb.close()
    assert all(r.passed == len(TESTS) for r in results), {r.status for r in results}
    return executions / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--executions", type=int, default=200)
    ap.add_argument("--parallel", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--levels", nargs="+", default=list(LEVELS))
    args = ap.parse_args()
    out = {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0], "results": []}
    for level in args.levels:
        try:
            Sandbox(level=level).isolation  # noqa: B018
        except ValueError as e:
            print(f"{level}: not available ({e})")
            continue
        for parallel in args.parallel:
            rates = [measure(level, parallel, args.executions) for _ in range(args.repeats)]
            row = {"level": level, "parallel": parallel, "per_s": rates}
            out["results"].append(row)
            print(f"{level:10} parallel={parallel}: {min(rates):.1f}-{max(rates):.1f} executions/s")
    out["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
