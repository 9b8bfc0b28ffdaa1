"""A run: its directory, version counter, step metrics, evaluation schedule and final model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from weir.config import Config, dump_config
from weir.telemetry import JsonlSink, MetricsLogger, TensorBoardSink, console_sink, timeline
from weir.telemetry.rollouts import dump_rollouts
from weir.telemetry.sinks import wandb_sink
from weir.telemetry.timeline import Timeline


def run_dir_of(cfg: Config) -> Path:
    return Path(cfg.run.dir or Path("runs") / cfg.run.name)


class RunError(RuntimeError):
    """The run cannot go on (e.g. too many failed samples in a step); the message says why."""


@dataclass
class Run:
    cfg: Config
    dir: Path
    logger: MetricsLogger
    version: int = 0
    last_step: int = 0
    timeline: Timeline | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    _t: float = field(default_factory=time.perf_counter)

    @classmethod
    def open(cls, cfg: Config, total_steps: int | None = None) -> Run:
        """Make the run directory, write the resolved config, open the metric sinks."""
        run_dir = run_dir_of(cfg)
        if run_dir.exists() and (run_dir / "metrics.jsonl").exists() and not cfg.run.overwrite:
            raise RunError(
                f"run directory {run_dir} already has metrics; set run.overwrite=true or a new run.dir"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        sinks = []
        if cfg.telemetry.jsonl:
            sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if cfg.telemetry.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if cfg.telemetry.wandb:
            sinks.append(wandb_sink(cfg, run_dir))
        if cfg.telemetry.console:
            total = cfg.run.steps if total_steps is None else total_steps
            sinks.append(console_sink(total, cfg.telemetry.progress))
        run = cls(cfg=cfg, dir=run_dir, logger=MetricsLogger(sinks))
        if cfg.telemetry.trace:
            run.timeline = Timeline(run_dir / "trace.json")
            timeline.use(run.timeline)
        return run

    def steps(self) -> range:
        return range(1, self.cfg.run.steps + 1)

    def bump_version(self) -> int:
        self.version += 1
        return self.version

    def should_eval(self, step: int) -> bool:
        every = self.cfg.run.eval_every
        return step == self.cfg.run.steps or (every > 0 and step % every == 0)

    @property
    def last_step_evaluated(self) -> bool:
        return bool(self.evals) and self.evals[-1]["step"] == self.last_step

    def log(self, step: int, *parts: dict[str, float]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for p in parts:
            metrics.update(p)
        now = time.perf_counter()
        metrics.setdefault(
            "time/step", now - self._t
        )  # drivers logging every k steps pass their own
        metrics["version"] = float(self.version)
        self._t, self.last_step = now, step
        self.history.append(metrics)
        if any(k.startswith("eval/") for k in metrics):
            self.evals.append(
                {"step": step, **{k: v for k, v in metrics.items() if k.startswith("eval/")}}
            )
        self.logger.log(step, metrics)
        return metrics

    def dump(self, step: int, groups) -> None:
        """Write the step's groups to rollouts/step_<step>.jsonl when telemetry.dump_rollouts is on."""
        if self.cfg.telemetry.dump_rollouts:
            dump_rollouts(self.dir / "rollouts" / f"step_{step:06d}.jsonl", step, groups)

    def close(self) -> None:
        self.logger.close()
        if self.timeline is not None:
            self.timeline.save()
            timeline.use(None)
