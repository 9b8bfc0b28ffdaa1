"""The live console: a progress display redrawn in place while a run trains (rich Live + Progress).

    step 12/50 ━━━━━━━━━━━╸━━━━━━━━━━━━━━━━━━━━━━━  24% 0:00:31 eta 0:01:38
    reward 0.625  eval_acc 0.410  len 3.9  ent 1.204  ...  gen tok/s 2086  s/step 2.61
    time  gen 41% train 52% sync 3%

Evaluation results are printed above the display, so they stay in the scrollback. Off a terminal
(CI logs, files) `console_sink` picks the plain-line `ConsoleSink` instead.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from weir.telemetry.sinks import format_metrics, time_split


class ProgressSink:
    """Step x of N with elapsed time and ETA, the latest step metrics, and the step's time split."""

    def __init__(self, total_steps: int, console: Console | None = None) -> None:
        self.total = total_steps
        self.console = console or Console(highlight=False)
        self.progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("train", total=total_steps)
        self.stats = Text("waiting for the first step…", style="dim")
        self.split = Text("")
        self.live = Live(self._view(), console=self.console, refresh_per_second=4)
        self.live.start()

    def _view(self) -> Group:
        return Group(self.progress, self.stats, self.split)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.progress.update(self.task, completed=step)
        self.stats = Text("  ".join(format_metrics(metrics)))
        split = time_split(metrics)
        self.split = Text(f"time  {split}", style="dim") if split else Text("")
        evals = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if evals:
            shown = "  ".join(
                f"{k.removeprefix('eval/')} {v:.3f}"
                for k, v in evals.items()
                if k in ("eval/accuracy", "eval/reward") or k.startswith("eval/pass@")
            )
            self.console.print(f"step {step}/{self.total}  eval  {shown}", markup=False)
        self.live.update(self._view(), refresh=True)

    def close(self) -> None:
        self.live.stop()
