"""The engine's memory as the loop sees it: asleep while the trainer trains (one device, time-sliced),
and a KV budget checked against the run's largest request before the run starts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from weir.config import Config
from weir.engine import TorchEngine
from weir.engine.local_replicas import LocalReplicas
from weir.engine.process_engine import ProcessEngine


@contextmanager
def engine_asleep(
    cfg: Config,
    engine: object,
    trainer_model: object,
    when: bool = True,
    *,
    update_follows: bool = False,
) -> Iterator[None]:
    """Within the block the built-in engine holds no KV cache (and, with
    engine.sleep_offload_weights, no weights when they are its own copy, not `trainer_model`); a
    server engine with engine.sleep_mode releases its memory (vLLM sleep, SGLang
    release_memory_occupation), a router of Ray replicas does as its `asleep` decides. Each wakes
    on exit, also on error. `update_follows` (the caller pushes new weights right after the block):
    offloaded weights are not copied back at the wake, the update writes them
    (weir.engine.memory.EngineMemory.wake_sync)."""
    server_asleep = getattr(engine, "asleep", None)
    builtin = isinstance(engine, (TorchEngine, ProcessEngine, LocalReplicas))
    if when and server_asleep is not None and not builtin:
        with server_asleep(update_follows):
            yield
        return
    if not (when and cfg.engine.sleep_while_training and builtin):
        yield
        return
    own_copy = getattr(engine, "model", None) is not trainer_model
    engine.sleep_sync(offload_weights=cfg.engine.sleep_offload_weights and own_copy)
    try:
        yield
    finally:
        engine.wake_sync(update_follows)


def check_kv_budget(cfg: Config, engine: TorchEngine) -> None:
    """Refuse at start-up a KV budget too small for the run's largest request (a prompt of
    data.max_prompt_tokens with rollout or eval n and max_new_tokens); the engine is closed first."""
    r, e = cfg.rollout, cfg.eval
    try:
        engine.check_fits(
            cfg.data.max_prompt_tokens,
            max(r.n, e.n),
            max(r.max_new_tokens, e.max_new_tokens or r.max_new_tokens),
        )
    except ValueError:
        engine.close()
        raise
