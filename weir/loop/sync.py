"""The synchronous driver: generate, score, train, push weights; one step after another."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from weir.config import Config
from weir.loop.components import Components, build
from weir.loop.engine_load import decode_path
from weir.loop.engine_memory import engine_asleep
from weir.loop.resume import say
from weir.loop.run import Run, RunError
from weir.rollout.collect import collect_groups, failure_summary
from weir.rollout.evaluate import evaluate
from weir.telemetry.timeline import span
from weir.train.batch import make_batch


@dataclass
class RunResult:
    dir: Path
    history: list[dict[str, float]]
    evals: list[dict[str, float]]
    model_dir: Path | None
    stopped: bool = False
    """True when a stop signal ended the run early; it resumes from its last checkpoint."""


def run_sync(
    cfg: Config,
    *,
    reward: Callable | None = None,
    rollout: Callable | None = None,
    filter: Callable | None = None,
) -> RunResult:
    """Train with the synchronous loop; plugins may be passed as Python objects instead of dotted paths."""
    run, parts = Run.open(cfg), None
    try:
        parts = build(cfg, run.dir, reward=reward, rollout=rollout, filter=filter)
        run.restore(parts)  # when resuming: weights, optimizer, RNG, data position, counters
        if not run.resumed:
            run.log(0, eval_metrics(parts))
        for step in run.steps():
            if parts.prompts.exhausted or run.stopping:  # data.epochs used up, or SIGINT / SIGTERM
                break
            rows = parts.prompts.next_batch(cfg.rollout.batch_prompts)
            groups, gen = collect_groups(parts.ctx, rows, parts.rollout_fn, keep=parts.keep)
            check_failures(cfg, groups, gen)
            run.dump(step, groups)
            batch = make_batch(groups, version=run.version)
            if batch is None:  # every group filtered out or failed: nothing to learn from
                run.log(step, gen, {"train/empty_steps": 1.0})
                continue
            with engine_asleep(cfg, parts.engine, parts.model, update_follows=True):
                stats = parts.trainer.train(batch, critic=parts.critic)
            sync = push_weights(parts, run.bump_version())
            evals = eval_metrics(parts) if run.should_eval(step) else {}
            path = decode_path(parts.engine.stats())
            run.log(step, gen, batch.metrics, stats, sync, path, evals)
            run.checkpoint(parts, step)
        return finish(run, parts)
    finally:
        if parts is not None:
            parts.close()
        run.close()


def finish(run: Run, parts: Components, buffer: Callable | None = None) -> RunResult:
    """Stopped by a signal: checkpoint and say how to resume. Otherwise evaluate the final policy
    (unless the last step did), checkpoint, and save the model."""
    if run.stopping:
        path = run.checkpoint(parts, run.last_step, force=True, buffer=buffer)
        say(
            f"stopped after step {run.last_step}; checkpoint {path or run.last_checkpoint}. "
            f"Resume with the same command (run.resume=auto continues from {run.dir}/checkpoints)."
        )
        return RunResult(run.dir, run.history, run.evals, None, stopped=True)
    if not run.last_step_evaluated:
        run.log(run.last_step, eval_metrics(parts))
    if run.cfg.run.checkpoint_every:
        run.checkpoint(parts, run.last_step, force=True, buffer=buffer)
    save = run.cfg.run.save_model
    model_dir = parts.save_model(run.dir) if save else None
    return RunResult(run.dir, run.history, run.evals, model_dir)


def push_weights(parts: Components, version: int) -> dict[str, float]:
    """Send the trainer's weights to the engine (in-process) and stamp the new version."""
    start = time.perf_counter()
    with span("sync", version=version):
        sync = getattr(parts, "sync", None)  # cluster.type=ray: trainer rank 0 -> the engines
        if sync is not None:
            return sync.push(version)
        asyncio.run(parts.engine.update_weights(parts.trainer.weights(), version))
    return {"time/sync": time.perf_counter() - start}


def eval_metrics(parts: Components) -> dict[str, float]:
    with span("eval"):
        metrics, _ = evaluate(
            parts.eval_ctx, parts.eval_rows, parts.rollout_fn, breakdown=parts.eval_breakdown
        )
    return metrics


def check_failures(cfg: Config, groups, gen: dict[str, float]) -> None:
    if gen["rollout/failed_frac"] > cfg.rollout.max_failed_fraction:
        raise RunError(
            f"{gen['rollout/failed_frac']:.0%} of this step's samples failed "
            f"(rollout.max_failed_fraction={cfg.rollout.max_failed_fraction}); most frequent: {failure_summary(groups)}"
        )
