"""Separate policies against one shared policy: memory and seconds per step of a multi-agent run.

The same two-role episode (a proposer answers a one-digit sum, a checker says yes or no; weir's
arithmetic task, the scorer below) trained with ``multi_agent.policies=shared`` and ``separate``,
each run in a fresh process, alternating shared, separate, shared, ... so that load drifting on the
machine affects both alike. Per run:

- ``s/step``: the median of ``time/step`` over the steps after the first (which warms up), and
  of its generation (``time/generate``) and training (``time/train``) parts;
- peak resident memory of the process (VmHWM), the whole run;
- the bytes the trainer side holds by construction: parameters, AdamW's two moments and the
  gradients, fp32 (4 + 8 + 4 bytes per parameter), per policy, summed.

    python benchmarks/separate_policies.py                          # tiny:tiny, 2 runs each
    python benchmarks/separate_policies.py --model tiny:small --runs 3 --steps 10

Prints a table (median and range over the runs) and writes every figure to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MB = 2**20


def score(episode: Any, row: dict) -> dict[str, float]:
    """proposer: its result is right; checker: its verdict is right; team: a right one accepted."""
    proposal = (episode.last("proposer") or "").strip()
    right = proposal == str(row["answer"])
    verdict = {"yes": True, "no": False}.get((episode.last("checker") or "").strip().lower())
    return {
        "team": float(right and verdict is True),
        "proposer": float(right),
        "checker": float(verdict is not None and verdict == right),
    }


def config(model: str, steps: int, seed: int, policies: str, run_dir: str) -> dict[str, Any]:
    return {
        "run": {
            "steps": steps,
            "seed": seed,
            "eval_every": 0,
            "save_model": False,
            "checkpoint_every": 0,
            "dir": run_dir,
        },
        "model": {"path": model, "threads": 1},
        "data": {"task": "arithmetic", "task_options": {"digits": 1}, "eval_size": 8},
        "rollout": {
            "function": "weir.rollout.multi_agent:rollout",
            "n": 8,
            "batch_prompts": 16,
            "max_new_tokens": 4,
        },
        "multi_agent": {
            "roles": [
                {"name": "proposer", "prompt": "propose the result"},
                {"name": "checker", "prompt": "check the result: yes or no"},
            ],
            "scorer": "separate_policies:score",
            "credit": "mixed",
            "policies": policies,
            "max_tokens": 16,
        },
        "algo": {"advantage": "grpo", "policy_loss": "ppo", "old_logprobs": "engine"},
        "train": {"lr": 1.0e-4},
        "telemetry": {"console": False},
    }


def one_run(model: str, steps: int, seed: int, policies: str) -> dict[str, Any]:
    """Train in this process and report (called in a child process by `main`)."""
    import torch

    import weir

    with tempfile.TemporaryDirectory() as tmp:
        result = weir.run(config(model, steps, seed, policies, str(Path(tmp) / "run")))
    steps = [h for h in result.history if "train/loss" in h][1:]
    hwm = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmHWM:")
    )
    from weir.train.model import load_model, resolve_model_path

    m, _ = load_model(resolve_model_path(model, Path(tempfile.gettempdir()) / "weir-bench-models"))
    params = sum(p.numel() for p in m.parameters())
    policies_n = 2 if policies == "separate" else 1
    return {
        "policies": policies,
        "seed": seed,
        "s_per_step": statistics.median(h["time/step"] for h in steps),
        "generate_s": statistics.median(h["time/generate"] for h in steps),
        "train_s": statistics.median(h["time/train"] for h in steps),
        "peak_rss_mb": hwm / MB,
        "trainer_state_mb": policies_n * params * 16 / MB,
        "params": params,
        "torch": torch.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2, help="runs per mode (seeds 0, 1, ...)")
    ap.add_argument("--out", default="separate_policies.json")
    ap.add_argument("--child", nargs=2, metavar=("POLICIES", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(args.model, args.steps, int(args.child[1]), args.child[0])))
        return
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    rows = []
    for seed in range(args.runs):
        for policies in ("shared", "separate"):
            cmd = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps)]
            out = subprocess.run(
                [*cmd, "--child", policies, str(seed)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], file=sys.stderr)
    load = os.getloadavg()
    print(
        f"{args.model}, {args.steps} steps x 16 prompts x 8 episodes, {args.runs} runs per mode, "
        f"{platform.machine()} {os.cpu_count()} cores, load average {load[0]:.1f}"
    )
    print("| | s/step | generate (s) | train (s) | peak RSS (MB) | params + AdamW + grads (MB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for policies in ("shared", "separate"):
        mine = [r for r in rows if r["policies"] == policies]

        def cell(key: str, fmt: str, mine: list = mine) -> str:
            v = [r[key] for r in mine]
            return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"

        print(
            f"| {policies} | {cell('s_per_step', '.2f')} | {cell('generate_s', '.2f')} | "
            f"{cell('train_s', '.2f')} | {cell('peak_rss_mb', '.0f')} | "
            f"{cell('trainer_state_mb', '.1f')} |"
        )
    Path(args.out).write_text(json.dumps({"rows": rows, "load": load}, indent=1))


if __name__ == "__main__":
    main()
