"""A run: its directory, version counter, step metrics, evaluation schedule and final model."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weir.config import Config, dump_config
from weir.loop.checkpointing import checkpoint_step, restore_run_checkpoint, save_run_checkpoint
from weir.loop.resume import StopSignal, cut_metrics, find_resume, say
from weir.loop.run_lock import RunDirInUse, RunLock
from weir.telemetry import JsonlSink, MetricsLogger, TensorBoardSink, console_sink, timeline
from weir.telemetry.rollouts import dump_rollouts
from weir.telemetry.sinks import wandb_sink
from weir.telemetry.timeline import Timeline, span

if TYPE_CHECKING:
    from weir.loop.components import Components


def run_dir_of(cfg: Config) -> Path:
    return Path(cfg.run.dir or Path("runs") / cfg.run.name)


class RunError(RuntimeError):
    """The run cannot go on (e.g. too many failed samples in a step); the message says why."""


def is_timing(key: str) -> bool:
    """Wall-clock figures: they differ between two runs of the same config (timings.jsonl when deterministic)."""
    return key.startswith(("time/", "throughput/")) or key.endswith(("/time", "_seconds"))


class _Only:
    """A sink that passes on only the metrics `keep` accepts (and nothing when none is left)."""

    def __init__(self, sink, keep) -> None:
        self.sink, self.keep = sink, keep

    def write(self, step: int, metrics: dict[str, float]) -> None:
        kept = {k: v for k, v in metrics.items() if self.keep(k)}
        if kept:
            self.sink.write(step, kept)

    def close(self) -> None:
        self.sink.close()


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
    resume_from: Path | None = None
    start_step: int = 0
    stop: StopSignal | None = None
    last_checkpoint: int | None = None
    lock: RunLock | None = None
    _t: float = field(default_factory=time.perf_counter)

    @classmethod
    def open(cls, cfg: Config, total_steps: int | None = None, *, resumable: bool = True) -> Run:
        """Make (or reopen) the run directory, write the resolved config, open the metric sinks.

        With `resumable` and a checkpoint to resume from (run.resume), the metrics files are cut back
        to the checkpoint's step and appended to; `restore` then loads the checkpoint.
        """
        run_dir = run_dir_of(cfg)
        try:  # before anything reads or writes the directory: one run per run directory
            lock = RunLock.acquire(run_dir)
        except RunDirInUse as err:
            raise RunError(str(err)) from None
        try:
            run = cls._open(cfg, run_dir, total_steps, resumable)
        except BaseException:
            lock.release()
            raise
        run.lock = lock
        return run

    @classmethod
    def _open(cls, cfg: Config, run_dir: Path, total_steps: int | None, resumable: bool) -> Run:
        resume_from = find_resume(cfg, run_dir) if resumable else None
        start = checkpoint_step(resume_from) if resume_from else 0
        if resume_from is None:
            if run_dir.exists() and (run_dir / "metrics.jsonl").exists() and not cfg.run.overwrite:
                raise RunError(
                    f"run directory {run_dir} already has metrics; set run.overwrite=true or a new run.dir"
                )
            if resumable and (run_dir / "checkpoints").exists():
                shutil.rmtree(
                    run_dir / "checkpoints"
                )  # a fresh start must not resume into them later
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        history = cut_metrics(run_dir, start) if resume_from else []
        append = resume_from is not None
        sinks = []
        if cfg.telemetry.jsonl:
            if cfg.run.deterministic:
                sinks.append(
                    _Only(
                        JsonlSink(run_dir / "metrics.jsonl", append=append),
                        lambda k: not is_timing(k),
                    )
                )
                sinks.append(_Only(JsonlSink(run_dir / "timings.jsonl", append=append), is_timing))
            else:
                sinks.append(JsonlSink(run_dir / "metrics.jsonl", append=append))
        if cfg.telemetry.tensorboard:
            purge = start + 1 if resume_from else None
            sinks.append(TensorBoardSink(run_dir / "tensorboard", purge_step=purge))
        if cfg.telemetry.wandb:
            sinks.append(wandb_sink(cfg, run_dir))
        if cfg.telemetry.console:
            total = cfg.run.steps if total_steps is None else total_steps
            sinks.append(console_sink(total, cfg.telemetry.progress))
        run = cls(cfg=cfg, dir=run_dir, logger=MetricsLogger(sinks), history=history)
        run.resume_from, run.start_step, run.last_step = resume_from, start, start
        if cfg.telemetry.trace:
            run.timeline = Timeline(run_dir / "trace.json")
            timeline.use(run.timeline)
        if resumable:
            run.stop = StopSignal.install()
        return run

    def restore(self, parts: Components) -> dict[str, Any] | None:
        """Load the checkpoint chosen by `open` into `parts`; returns the saved async buffer state.

        Returns None, and does nothing, for a fresh run (check `resumed`)."""
        if self.resume_from is None:
            return None
        buffer = restore_run_checkpoint(self.resume_from, self, parts)
        self.last_checkpoint = self.start_step
        say(f"resumed from {self.resume_from} (step {self.start_step}, version {self.version})")
        if self.start_step >= self.cfg.run.steps:
            say(
                f"the run already reached run.steps={self.cfg.run.steps}; raise run.steps to train "
                "on, or set run.resume=never to start over"
            )
        return buffer

    @property
    def resumed(self) -> bool:
        return self.resume_from is not None

    @property
    def stopping(self) -> bool:
        """A stop signal (SIGINT / SIGTERM) arrived: finish this step, checkpoint, exit."""
        return self.stop is not None and self.stop.requested

    def checkpoint(
        self, parts: Components, step: int, *, force: bool = False, buffer: Callable | None = None
    ) -> Path | None:
        """Write a checkpoint when one is due (every run.checkpoint_every steps, at the last step, or
        `force`d by a stop); `buffer()` gives the async loop's buffer state."""
        every = self.cfg.run.checkpoint_every
        due = force or (every > 0 and (step % every == 0 or step == self.cfg.run.steps))
        if not due or self.last_checkpoint == step:
            return None
        with span("checkpoint", step=step):
            path = save_run_checkpoint(self, parts, step, buffer() if buffer else None)
        self.last_checkpoint = step
        return path

    def steps(self) -> range:
        return range(self.start_step + 1, self.cfg.run.steps + 1)

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
        try:
            if self.stop is not None:
                self.stop.uninstall()
            self.logger.close()
            if self.timeline is not None:
                self.timeline.save()
                timeline.use(None)
        finally:
            if self.lock is not None:
                self.lock.release()
