"""Where step metrics go: JSONL in the run directory (always), and a compact console line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...
    def close(self) -> None: ...


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    return v


class JsonlSink:
    """One JSON object per line: {"step": N, "metric": value, ...}; NaN is written as null."""

    def __init__(self, path: str | Path, *, append: bool = False) -> None:
        self.path = Path(path)
        self._fh = self.path.open("a" if append else "w", encoding="utf-8")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


CONSOLE_KEYS = [
    ("sft/loss", "loss", "{:.4f}"),
    ("reward/mean", "reward", "{:.3f}"),
    ("eval/accuracy", "eval_acc", "{:.3f}"),
    ("response/length_mean", "len", "{:.1f}"),
    ("train/entropy", "ent", "{:.3f}"),
    ("policy/clip_frac", "clip", "{:.3f}"),
    ("mismatch/abs_logp_diff", "|Δlogp|", "{:.1e}"),
    ("train/grad_norm", "gnorm", "{:.2f}"),
    ("throughput/gen_tokens_per_s", "gen tok/s", "{:.0f}"),
    ("time/step", "s/step", "{:.2f}"),
]


class ConsoleSink:
    """A one-line summary per step; rich colours on a terminal, plain text in logs."""

    def __init__(self, total_steps: int, console: Console | None = None) -> None:
        self.total = total_steps
        self.console = console or Console(highlight=False)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"step {step}/{self.total}"]
        for key, label, fmt in CONSOLE_KEYS:
            v = metrics.get(key)
            if isinstance(v, int | float) and math.isfinite(v):
                parts.append(f"{label} {fmt.format(v)}")
        self.console.print("  ".join(parts), soft_wrap=True)

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars for TensorBoard (needs the `tensorboard` package: pip install 'weir[tensorboard]')."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ValueError(
                "telemetry.tensorboard=true needs the tensorboard package: pip install 'weir[tensorboard]'"
            ) from err
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    """Fan step metrics out to every configured sink."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for s in self.sinks:
            s.write(step, metrics)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
