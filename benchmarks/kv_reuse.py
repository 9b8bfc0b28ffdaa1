"""Cross-turn KV reuse on the calculator agent task: prefill tokens and rollout time, cache on vs off.

A tool-calling episode calls the engine once per model turn with the whole conversation; with
`engine.prefix_cache` the next turn reuses the KV of the turn before and prefills only the new
tokens. Both settings roll out the same prompts with the same per-turn seeds, alternating, each on a
fresh engine; the trajectories must come out identical (the cache changes no sample).

    python benchmarks/kv_reuse.py                          # SFT a calculator model first (~3 min)
    python benchmarks/kv_reuse.py --model runs/calc/model  # reuse an SFT'd calculator model
    python benchmarks/kv_reuse.py --turns 6 --prompts 32   # more turns per episode
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import weir
from weir.config import load_config
from weir.loop.components import load_run_model, make_contexts, make_engine, task_rows
from weir.plugins import resolve
from weir.rollout.collect import collect_groups

BASE = str(Path(__file__).parents[1] / "examples" / "calculator.yaml")
QUIET = ["telemetry.console=false", "run.save_model=true"]


def rollout_once(overrides: list[str], rows: list[dict], cache: bool) -> dict[str, float]:
    cfg = load_config(BASE, [*overrides, f"engine.prefix_cache={str(cache).lower()}"])
    model, tokenizer = load_run_model(cfg, Path(cfg.run.dir))
    engine = make_engine(cfg, model.eval(), tokenizer)
    try:
        ctx, _ = make_contexts(cfg, engine, tokenizer)
        ctx = ctx.with_sampling(seed=cfg.run.seed)  # per-turn seeds: the same samples either way
        fn = resolve(cfg.rollout.function, {}, "rollout.function")
        start = time.perf_counter()
        groups, _ = collect_groups(ctx, rows, fn)
        wall = time.perf_counter() - start
        stats = engine.stats()
    finally:
        engine.close()
    samples = [s for g in groups for s in g.samples]
    return {
        "wall_s": wall,
        "engine_busy_s": stats["busy_s"],
        "prefill_tokens": stats["prefill_tokens"],
        "reused_tokens": stats.get("prefix_reused_tokens", 0.0),
        "hits": stats.get("prefix_hits", 0.0),
        "generated_tokens": stats["generated_tokens"],
        "turns": statistics.mean(s.reward_info["turns"] for s in samples),
        "trajectories": [tuple(s.response_ids) for s in samples],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="an SFT'd calculator model (default: SFT one now)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3, help="agent.max_turns")
    ap.add_argument("--reps", type=int, default=3, help="runs per setting, alternating")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model or str(
            weir.sft(BASE, [*QUIET, f"run.dir={root / 'sft'}", f"model.threads={args.threads}"])
        )
        overrides = [
            *QUIET,
            f"model.path={model}",
            f"model.threads={args.threads}",
            f"run.dir={root / 'bench'}",
            f"rollout.n={args.n}",
            f"agent.max_turns={args.turns}",
            f"agent.max_tokens={32 * args.turns}",
        ]
        cfg = load_config(BASE, overrides)
        rows = task_rows(cfg, "train")[: args.prompts]
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for _ in range(args.reps):
            for cache in (False, True):
                runs[cache].append(rollout_once(overrides, rows, cache))
    same = all(
        a["trajectories"] == b["trajectories"] for a, b in zip(runs[True], runs[False], strict=True)
    )
    print(
        f"calculator agent, {args.prompts} prompts x n={args.n}, max_turns={args.turns}, "
        f"{args.reps} runs per setting, {args.threads} torch thread(s), "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"mean model turns per episode: {runs[True][0]['turns']:.2f}")
    head = f"{'prefix cache':<14}{'prefill tok':>12}{'reused tok':>11}{'hits':>6}"
    print(head + f"{'gen tok':>9}{'engine busy s (range)':>24}{'rollout s (range)':>20}")
    for cache in (False, True):
        r = runs[cache]
        busy = [x["engine_busy_s"] for x in r]
        wall = [x["wall_s"] for x in r]
        print(
            f"{'on' if cache else 'off':<14}{r[0]['prefill_tokens']:>12.0f}"
            f"{r[0]['reused_tokens']:>11.0f}{r[0]['hits']:>6.0f}{r[0]['generated_tokens']:>9.0f}"
            f"{statistics.median(busy):>10.2f} ({min(busy):.2f}-{max(busy):.2f})"
            f"{statistics.median(wall):>9.2f} ({min(wall):.2f}-{max(wall):.2f})"
        )
    print(f"identical trajectories with and without the cache: {same}")


if __name__ == "__main__":
    main()
