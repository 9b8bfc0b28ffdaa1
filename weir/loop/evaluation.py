"""The eval driver: a model, held-out rows and a reward, scored with the built-in engine."""

from __future__ import annotations

from pathlib import Path

from weir.config import Config
from weir.loop.components import load_run_model, make_contexts, make_engine, task_rows
from weir.plugins import resolve
from weir.rollout.evaluate import evaluate


def run_eval(cfg: Config) -> dict[str, float]:
    """Mean reward, accuracy and pass@k of `cfg.model.path` on the eval split."""
    model, tokenizer = load_run_model(cfg, Path(cfg.run.dir or "runs/eval"))
    engine = make_engine(cfg, model.eval(), tokenizer)
    try:
        _, eval_ctx = make_contexts(cfg, engine, tokenizer)
        fn = resolve(cfg.rollout.function, {}, "rollout.function")
        metrics, _ = evaluate(eval_ctx, task_rows(cfg, "test"), fn)
        return metrics
    finally:
        engine.close()
