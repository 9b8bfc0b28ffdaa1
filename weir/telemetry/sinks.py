"""Where step metrics go: JSONL in the run directory, the console, TensorBoard, Weights & Biases."""

from __future__ import annotations

import json
import math
import time
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
    ("policy/clipfrac_high", "clip", "{:.3f}"),
    ("mismatch/abs_logp_diff", "|Δlogp|", "{:.1e}"),
    ("train/grad_norm", "gnorm", "{:.2f}"),
    ("throughput/gen_tokens_per_s", "gen tok/s", "{:.0f}"),
    ("throughput/train_tokens_per_s", "train tok/s", "{:.0f}"),
    ("time/step", "s/step", "{:.2f}"),
]

# the phases of a step, as (metric, label): their share of `time/step` is the time split
TIME_SPLIT = [
    ("time/generate", "gen"),
    ("time/wait_for_batch", "wait"),
    ("time/train", "train"),
    ("time/sync", "sync"),
    ("eval/time", "eval"),
]


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)


def format_metrics(metrics: dict[str, float]) -> list[str]:
    """`label value` pieces for the metrics of CONSOLE_KEYS that this step has."""
    return [
        f"{label} {fmt.format(metrics[key])}"
        for key, label, fmt in CONSOLE_KEYS
        if _finite(metrics.get(key))
    ]


def time_split(metrics: dict[str, float]) -> str:
    """Each phase's share of the step's wall time, e.g. `gen 41% train 52% sync 3%`."""
    total = metrics.get("time/step")
    if not _finite(total) or total <= 0:
        return ""
    parts = [
        f"{label} {metrics[key] / total:.0%}"
        for key, label in TIME_SPLIT
        if _finite(metrics.get(key))
    ]
    return " ".join(parts)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class EtaClock:
    """Estimated time left: mean wall time per step so far times the steps still to go."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._start: tuple[int, float] | None = None

    def update(self, step: int) -> float | None:
        now = time.perf_counter()
        if self._start is None:
            self._start = (step, now)
            return None
        first, t0 = self._start
        if step <= first:
            return None
        return (now - t0) / (step - first) * max(0, self.total - step)


class ConsoleSink:
    """One plain line per step (for logs and files; `ProgressSink` is the live display):

    `step 3/20  eta 0:41  reward 0.412  len 3.9  ...  time gen 41% train 52% sync 3%`
    """

    def __init__(self, total_steps: int, console: Console | None = None) -> None:
        self.total = total_steps
        self.console = console or Console(highlight=False)
        self.eta = EtaClock(total_steps)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"step {step}/{self.total}"]
        eta = self.eta.update(step)
        if eta is not None and step < self.total:
            parts.append(f"eta {format_duration(eta)}")
        parts += format_metrics(metrics)
        split = time_split(metrics)
        if split:
            parts.append(f"time {split}")
        self.console.print("  ".join(parts), soft_wrap=True, markup=False)

    def close(self) -> None:
        pass


def console_sink(
    total_steps: int, style: str = "auto", console: Console | None = None
) -> ConsoleSink | Any:
    """The console sink for `telemetry.progress`: live on a terminal (or `live`), plain lines else."""
    console = console or Console(highlight=False)
    if style == "live" or (style == "auto" and console.is_terminal):
        from weir.telemetry.console import ProgressSink

        return ProgressSink(total_steps, console)
    return ConsoleSink(total_steps, console)


class TensorBoardSink:
    """Scalars for TensorBoard (needs the `tensorboard` package: pip install 'weir[tensorboard]')."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        """`purge_step`: a resumed run's first step; TensorBoard drops the earlier attempt's events
        from that step on, so the replayed steps are not shown twice."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ValueError(
                "telemetry.tensorboard=true needs the tensorboard package: pip install 'weir[tensorboard]'"
            ) from err
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Step metrics to Weights & Biases (pip install 'weir[wandb]'), offline by default.

    Offline runs live in <dir>/wandb/offline-run-*/ and never touch the network; `wandb sync`
    uploads them later. wandb's own service process writes the files, and may still be finishing
    them for a moment after `close()` returns.
    """

    def __init__(
        self,
        dir: str | Path,
        *,
        project: str,
        name: str,
        config: dict[str, Any] | None = None,
        mode: str = "offline",
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ValueError(
                "telemetry.wandb=true needs the wandb package: pip install 'weir[wandb]'"
            ) from err
        Path(dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            name=name,
            dir=str(dir),
            config=config,
            mode=mode,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log({k: v for k, v in metrics.items() if _finite(v)}, step=step)

    def close(self) -> None:
        self._run.finish()


def wandb_sink(cfg: Any, run_dir: Path) -> WandbSink:
    """The W&B sink for a run's config (`telemetry.wandb_project`, `telemetry.wandb_mode`)."""
    t = cfg.telemetry
    return WandbSink(
        run_dir,
        project=t.wandb_project,
        name=cfg.run.name,
        config=cfg.model_dump(mode="json"),
        mode=t.wandb_mode,
    )


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
