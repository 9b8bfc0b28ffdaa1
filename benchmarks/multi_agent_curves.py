"""Per-role learning curves of multi-agent runs, as the markdown tables in docs/multi-agent.md.

    python benchmarks/multi_agent_curves.py runs/demo_s0/rl runs/demo_s1/rl [--every 5]

For each run directory (its metrics.jsonl): the training reward of each role (the scorer's own
reward, `reward/<role>/own_mean`, over all sampled episodes of the step) and the team reward,
averaged over windows of `--every` steps; then the held-out greedy evaluations (team accuracy and
each role's accuracy) at every evaluated step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def roles_of(rows: list[dict]) -> list[str]:
    return sorted(
        {
            k.split("/")[1]
            for r in rows
            for k in r
            if k.startswith("reward/") and k.endswith("/own_mean")
        }
    )


def training_table(rows: list[dict], every: int) -> str:
    roles = roles_of(rows)
    keys = [f"reward/{r}/own_mean" for r in roles] + ["reward/team/mean"]
    steps = [r for r in rows if keys[0] in r]
    head = "| steps | " + " | ".join([*roles, "team"]) + " |"
    out = [head, "|" + " --- |" * (len(keys) + 1)]
    for i in range(0, len(steps), every):
        chunk = steps[i : i + every]
        means = [sum(r[k] for r in chunk) / len(chunk) for k in keys]
        span = f"{chunk[0]['step']}-{chunk[-1]['step']}"
        out.append(f"| {span} | " + " | ".join(f"{m:.2f}" for m in means) + " |")
    return "\n".join(out)


def eval_table(rows: list[dict]) -> str:
    roles = roles_of(rows)
    evals = [r for r in rows if "eval/accuracy" in r]
    out = ["| step | team | " + " | ".join(roles) + " |", "|" + " --- |" * (len(roles) + 2)]
    for r in evals:
        cells = [f"{r['eval/accuracy']:.1%}"] + [
            f"{r.get(f'eval/{x}/accuracy', float('nan')):.1%}" for x in roles
        ]
        out.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--every", type=int, default=5)
    args = ap.parse_args()
    for run in args.runs:
        rows = load(run)
        print(f"### {run}\n\ntraining reward per role (sampled, mean over steps)\n")
        print(training_table(rows, args.every))
        print("\nheld-out greedy accuracy\n")
        print(eval_table(rows))
        print()


if __name__ == "__main__":
    main()
