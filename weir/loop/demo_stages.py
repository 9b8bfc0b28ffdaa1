"""Demos in several RL stages: SFT, then one RL run per stage, each starting from the model the one
before it left, with the held-out success before and after each stage.

`weir demo --task gui` is the Mobile-R1 recipe at toy size: SFT on a few demonstrations, then
action-level RL (examples/gui_action.yaml), then task-level RL (examples/gui.yaml). Every stage's
evaluation plays the same held-out episodes, so its first evaluation is the "before" of the stage
and its last the "after". The GUI demo samples its evaluations (temperature 1, 8 episodes per goal:
1536 episodes, a binomial standard error of about 1.2 points), so one evaluation is the figure, not a mean.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from weir.config import load_config
from weir.loop.sft import run_sft
from weir.loop.sync import run_sync

__all__ = ["STAGES", "run_staged_demo"]

STAGES: dict[str, list[tuple[str, str]]] = {
    "gui": [("action-level RL", "gui_action"), ("task-level RL", "gui")],
}
"""For a demo task with several RL stages: (what the stage is, its examples/<name>.yaml), in order.
SFT runs from the task's own examples/<task>.yaml."""


def run_staged_demo(
    task: str, examples: Path, out: Path, overrides: list[str], console: Console
) -> dict[str, Any]:
    """SFT, then each of `STAGES[task]`; returns (and writes to out/demo.json) the success after
    SFT and before and after every stage (its first and last evaluations), with the minutes of
    each."""
    stages = STAGES[task]
    t0 = time.perf_counter()
    console.rule(f"[bold]weir demo: {task}[/bold] — 1/{len(stages) + 1} supervised warm start")
    sft_cfg = load_config(examples / f"{task}.yaml", [*overrides, f"run.dir={out / 'sft'}"])
    model = run_sft(sft_cfg)
    summary: dict[str, Any] = {"sft_seconds": time.perf_counter() - t0}
    rows: list[tuple[str, float, float, float]] = []
    for i, (what, name) in enumerate(stages, start=2):
        console.rule(f"{i}/{len(stages) + 1} {what} ({name}.yaml)")
        t = time.perf_counter()
        cfg = load_config(
            examples / f"{name}.yaml",
            [
                "run.resume=never",
                "telemetry.dump_rollouts=true",
                *overrides,
                f"run.dir={out / name}",
                f"model.path={model}",
            ],
        )
        result = run_sync(cfg)
        accs = [e["eval/accuracy"] for e in result.evals]
        before, after = accs[0], accs[-1]
        minutes = (time.perf_counter() - t) / 60
        summary.update(
            {
                f"{name}/success_before": before,
                f"{name}/success_after": after,
                f"{name}/success_evals": accs,
                f"{name}/seconds": minutes * 60,
                f"{name}/steps": cfg.run.steps,
            }
        )
        for key in result.evals[0]:
            parts = key.split("/")
            if len(parts) == 4 and parts[0] == "eval" and parts[3] == "accuracy":
                summary[f"{name}/{parts[1]}={parts[2]}/before"] = result.evals[0][key]
                summary[f"{name}/{parts[1]}={parts[2]}/after"] = result.evals[-1][key]
        rows.append((what, before, after, minutes))
        model = result.model_dir
        summary["eval_prompts"] = result.evals[0]["eval/prompts"]
    summary["total_seconds"] = time.perf_counter() - t0
    temp = cfg.eval.temperature
    how = "greedy" if temp == 0 else f"sampled (T={temp:g}, {cfg.eval.n} per goal)"
    table = Table(title=f"held-out {how} success ({int(summary['eval_prompts'])} goals)")
    for col in ("stage", "before", "after", "minutes"):
        table.add_column(col)
    table.add_row("SFT", "", f"{rows[0][1]:.1%}", f"{summary['sft_seconds'] / 60:.1f}")
    for what, before, after, minutes in rows:
        table.add_row(what, f"{before:.1%}", f"{after:.1%}", f"{minutes:.1f}")
    console.print(table)
    console.print(f"total {summary['total_seconds'] / 60:.1f} min; trained model: {model}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(summary, indent=2))
    return summary
