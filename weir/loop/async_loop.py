"""The asynchronous driver: rollout runs continuously; the trainer takes batches as they are ready.

Admission control (weir.buffer) keeps every trained group at most `loop.max_staleness` weight
versions behind; new weights reach the engine between decode steps, and responses in flight
continue under them with each token stamped by the version that produced it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from weir.buffer import BufferClosed, StalenessBuffer
from weir.config import Config
from weir.loop.components import Components, build
from weir.loop.engine_load import EngineLoad
from weir.loop.engine_memory import engine_asleep
from weir.loop.producer import RolloutProducer
from weir.loop.run import Run, RunError
from weir.loop.sync import RunResult, check_failures, eval_metrics, finish, push_weights
from weir.rollout.collect import summarize
from weir.telemetry.timeline import span
from weir.train.batch import make_batch, mask_stale_prefix


def run_async(
    cfg: Config,
    *,
    reward: Callable | None = None,
    rollout: Callable | None = None,
    filter: Callable | None = None,
) -> RunResult:
    """Train with rollout and training overlapped; `loop.max_staleness=0` trains exactly like run_sync."""
    run = Run.open(cfg)
    try:
        parts = build(cfg, run.dir, reward=reward, rollout=rollout, filter=filter)
    except BaseException:
        run.close()
        raise
    if cfg.loop.trainer_threads:
        torch.set_num_threads(cfg.loop.trainer_threads)
    buffer = StalenessBuffer(cfg.rollout.batch_prompts, cfg.loop.max_staleness)
    # admission reads the engine's version: it changes only once the new weights are in the engine
    policy, finish_timeout = cfg.loop.on_weight_update, cfg.loop.finish_timeout_s
    producer = RolloutProducer(
        parts.ctx,
        parts.rollout_fn,
        parts.prompts,
        buffer,
        lambda: parts.engine.version,
        parts.keep,
        regenerate_aborted=policy == "abort",
    )
    colocated = cfg.loop.placement == "colocated"
    load = EngineLoad(parts.engine)
    try:
        saved = run.restore(parts)
        if saved is not None:
            producer.restore(saved)
        elif not run.resumed:
            run.log(0, eval_metrics(parts))
        producer.start()
        for step in run.steps():
            if run.stopping:
                break
            waited = time.perf_counter()
            with span("wait", cat="idle"):
                groups = next_batch(buffer, producer, run.version)
            if groups is None:  # the data ran out
                break
            waited = time.perf_counter() - waited
            masked = (
                {"rollout/masked_stale_tokens": float(mask_stale_prefix(groups))}
                if policy == "mask_stale"
                else {}
            )
            gen = summarize(groups)
            check_failures(cfg, groups, gen)
            run.dump(step, groups)
            batch = make_batch(groups, version=run.version)
            if batch is None:
                run.log(step, gen, {"train/empty_steps": 1.0})
                continue
            held = hold_engine(parts.engine, policy, finish_timeout) if colocated else {}
            with engine_asleep(cfg, parts.engine, parts.model, when=colocated):
                stats = parts.trainer.train(batch, critic=parts.critic)
            sync = swap_weights(parts, run.bump_version(), policy, finish_timeout, held=colocated)
            if colocated:
                parts.engine.resume_sync()
            evals = eval_metrics(parts) if run.should_eval(step) else {}
            flow = {"time/wait_for_batch": waited, "buffer/depth": float(buffer.stats()["depth"])}
            run.log(
                step,
                gen,
                masked,
                batch.metrics,
                stats,
                sync,
                held,
                flow,
                load.sample(),
                producer.take_counts(),
                evals,
            )
            run.checkpoint(parts, step, buffer=producer.snapshot)
        return finish(run, parts, buffer=producer.snapshot)
    finally:
        producer.stop()
        parts.close()
        run.close()


def next_batch(buffer: StalenessBuffer, producer: RolloutProducer, version: int) -> list | None:
    """The next batch from the buffer; None when the data is exhausted; the producer's error if it died."""
    try:
        return buffer.get_batch(version)
    except BufferClosed:
        if producer.error is not None:
            raise RunError(
                f"the rollout producer failed: {type(producer.error).__name__}: {producer.error}"
            ) from producer.error
        return None


def hold_engine(engine, policy: str, timeout: float | None = None) -> dict[str, float]:
    """Colocated: stop the engine for the trainer between decode steps; with `finish`, once the
    responses in flight have ended under the weights they started with (or `timeout` passed)."""
    if policy == "finish":
        drained = drain(engine, timeout)
        if drained["async/drain_timeouts"]:
            engine.pause_sync()  # the rest wait, paused, and go on under the new weights
        return drained
    engine.pause_sync()
    return {}


def swap_weights(
    parts: Components,
    version: int,
    policy: str,
    timeout: float | None = None,
    *,
    held: bool = False,
) -> dict[str, float]:
    """Push new weights between decode steps (`loop.on_weight_update`): with `abort`, responses in
    flight end first and the producer regenerates them under the new weights; with `finish`, they
    end under the old weights first (those still running after `timeout` seconds go on under the
    new ones), the engine admitting nothing new until the new weights are in. `held`: `hold_engine`
    already drained (or paused) it."""
    if policy not in ("abort", "finish"):
        return push_weights(parts, version)
    try:
        if policy == "finish":
            drained = {} if held else drain(parts.engine, timeout)
            return {**push_weights(parts, version), **drained}
        parts.engine.pause_sync()
        parts.engine.abort_sync()
        return push_weights(parts, version)
    finally:
        parts.engine.resume_sync()


def drain(engine, timeout: float | None = None) -> dict[str, float]:
    """Wait for the engine's responses in flight to end, holding new ones, at most `timeout`
    seconds (`time/drain`; `async/drain_timeouts`: 1 when some were still running then)."""
    start = time.perf_counter()
    with span("drain", cat="idle"):
        done = engine.drain_sync(timeout)
    return {"time/drain": time.perf_counter() - start, "async/drain_timeouts": float(not done)}
