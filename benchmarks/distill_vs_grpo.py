"""On-policy distillation against GRPO at equal steps, on addition with weir's tiny models.

    python benchmarks/distill_vs_grpo.py --out runs/distill --seeds 0 1 2 --steps 20

1. The teacher: weir's `tiny:small` model (4x the parameters of the student's `tiny:tiny`), SFT
   on correct answers (`--teacher-rows` x `--teacher-epochs`).
2. Per seed, the student: `tiny:tiny` after a short SFT (`--student-rows` x `--student-epochs`, a
   share `--corrupt` of its targets wrong by one in the last digit): it rarely samples an answer
   right in every digit, so the 0/1 reward is sparse. The same starting point for both methods.
3. From it, `--steps` RL steps each (32 prompts x 8 samples a step, lr 5e-5; the settings of
   examples/arithmetic_quick.yaml but `--digits`-digit operands): GRPO from the 0/1 reward, and
   distillation (`algo.distill.teacher=<the teacher>`, reward_weight 0: the reward is then only
   measured). The same prompts, the same seeds.

It prints, as markdown tables for docs/distillation.md: the mean training reward (fraction of
correct samples) in windows of steps, and the greedy held-out accuracy at every evaluation, as
the mean over seeds with the range. The numbers are deterministic per seed (run.deterministic);
the machine only changes the time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from weir.config import load_config
from weir.loop.sft import run_sft
from weir.loop.sync import run_sync

QUICK = Path(__file__).resolve().parents[1] / "examples" / "arithmetic_quick.yaml"
BASE = ["run.resume=never", "run.deterministic=true", "telemetry.console=false"]


def train_teacher(out: Path, task: list[str], rows: int, epochs: int) -> tuple[str, float]:
    """SFT `tiny:small` on correct answers; its directory and greedy held-out accuracy."""
    sft = [f"sft.rows={rows}", f"sft.epochs={epochs}", "sft.task_options.corrupt=0.0"]
    cfg = load_config(
        QUICK, [*BASE, *task, *sft, "model.path=tiny:small", f"run.dir={out / 'sft'}"]
    )
    path = str(run_sft(cfg))
    check = load_config(
        QUICK, [*BASE, *task, f"model.path={path}", "run.steps=0", f"run.dir={out / 'eval'}"]
    )
    evals = run_sync(check).evals
    return path, evals[0]["eval/accuracy"]


def student(out: Path, seed: int, task: list[str], sft: list[str]) -> str:
    cfg = load_config(QUICK, [*BASE, *task, *sft, f"run.seed={seed}", f"run.dir={out / 'sft'}"])
    return str(run_sft(cfg))


def rl(
    out: Path, start: str, seed: int, steps: int, every: int, extra: list[str], task: list[str]
) -> dict:
    cfg = load_config(
        QUICK,
        [
            *BASE,
            *task,
            f"run.seed={seed}",
            f"run.steps={steps}",
            f"run.eval_every={every}",
            f"model.path={start}",
            f"run.dir={out}",
            *extra,
        ],
    )
    t0 = time.perf_counter()
    res = run_sync(cfg)
    return {
        "reward": [h["reward/mean"] for h in res.history if "reward/mean" in h],
        "evals": [(e["step"], e["eval/accuracy"]) for e in res.evals],
        "seconds": time.perf_counter() - t0,
    }


def cell(values: list[float], pct: bool) -> str:
    mean = sum(values) / len(values)
    fmt = (lambda v: f"{100 * v:.0f}%") if pct else (lambda v: f"{v:.2f}")
    return f"{fmt(mean)} ({fmt(min(values))}-{fmt(max(values))})"


def tables(results: dict[str, list[dict]], window: int) -> str:
    methods = list(results)
    steps = len(results[methods[0]][0]["reward"])
    out = ["| steps | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for lo in range(0, steps, window):
        hi = min(lo + window, steps)
        cells = []
        for m in methods:
            per_seed = [sum(r["reward"][lo:hi]) / (hi - lo) for r in results[m]]
            cells.append(cell(per_seed, False))
        out.append(f"| {lo + 1}-{hi} | " + " | ".join(cells) + " |")
    out += ["", "| step | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for i, (step, _) in enumerate(results[methods[0]][0]["evals"]):
        cells = [cell([r["evals"][i][1] for r in results[m]], True) for m in methods]
        out.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/distill_vs_grpo"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--digits", type=int, default=1, help="operand digits of the additions")
    ap.add_argument("--teacher-rows", type=int, default=3000)
    ap.add_argument("--teacher-epochs", type=int, default=4)
    ap.add_argument("--student-rows", type=int, default=3000)
    ap.add_argument("--student-epochs", type=int, default=4)
    ap.add_argument(
        "--corrupt", type=float, default=0.95, help="share of wrong answers in the student's SFT"
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    task = [
        f"data.task_options.digits={args.digits}",
        f"rollout.max_new_tokens={args.digits + 3}",
    ]
    teacher, teacher_acc = train_teacher(
        args.out / "teacher", task, args.teacher_rows, args.teacher_epochs
    )
    print(f"teacher: {teacher}, greedy held-out accuracy {teacher_acc:.1%}", flush=True)
    methods = {
        "GRPO (sparse reward)": [],
        "distillation": [f"algo.distill.teacher={teacher}"],
    }
    results: dict[str, list[dict]] = {m: [] for m in methods}
    for seed in args.seeds:
        sft = [
            f"sft.rows={args.student_rows}",
            f"sft.epochs={args.student_epochs}",
            f"sft.task_options.corrupt={args.corrupt}",
        ]
        start = student(args.out / f"student_s{seed}", seed, task, sft)
        for name, extra in methods.items():
            tag = "grpo" if not extra else "distill"
            r = rl(
                args.out / f"{tag}_s{seed}", start, seed, args.steps, args.eval_every, extra, task
            )
            results[name].append(r)
            last = r["evals"][-1][1]
            print(
                f"seed {seed} {name}: accuracy {r['evals'][0][1]:.0%} -> {last:.0%} "
                f"({r['seconds']:.0f} s)",
                flush=True,
            )
    (args.out / "results.json").write_text(
        json.dumps({"teacher_accuracy": teacher_acc, "results": results}, indent=1)
    )
    print(
        f"\nteacher greedy accuracy {teacher_acc:.1%}; {len(args.seeds)} seeds; "
        f"total {time.perf_counter() - t0:.0f} s\n"
    )
    print(tables(results, args.window))


if __name__ == "__main__":
    main()
