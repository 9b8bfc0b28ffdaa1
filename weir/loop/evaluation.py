"""The eval driver: a model, held-out rows and a reward, scored with the built-in engine."""

from __future__ import annotations

from pathlib import Path

from weir.config import Config, load_config
from weir.loop.components import (
    load_run_model,
    make_contexts,
    make_engine,
    separate_policies,
    task_rows,
)
from weir.loop.role_policies import eval_engines
from weir.plugins import resolve
from weir.rollout.evaluate import evaluate

# what `weir eval MODEL` uses for a bare model directory or hub name, unless a flag says otherwise
DEFAULTS = {"n": 1, "temperature": 0.0, "size": 500, "max_new_tokens": 64, "seed": 0}
# tasks whose prompts and answers are longer: their defaults (flags still win), and config overrides
TASK_DEFAULTS = {"humaneval": {"max_new_tokens": 512}}
TASK_OVERRIDES = {"humaneval": ["data.max_prompt_tokens=2048"]}


def run_eval(cfg: Config) -> dict[str, float]:
    """Mean reward, accuracy and pass@k of `cfg.model.path` on the eval split (a run with
    multi_agent.policies=separate: each role's policy from ``<model.path>/<role>``)."""
    if separate_policies(cfg):
        engine, tokenizer = eval_engines(cfg, lambda c, m, t, *_: make_engine(c, m, t))
    else:
        model, tokenizer = load_run_model(cfg, Path(cfg.run.dir or "runs/eval"))
        engine = make_engine(cfg, model.eval(), tokenizer)
    try:
        _, eval_ctx = make_contexts(cfg, engine, tokenizer)
        fn = resolve(cfg.rollout.function, {}, "rollout.function")
        metrics, _ = evaluate(eval_ctx, task_rows(cfg, "test"), fn, breakdown=cfg.eval.breakdown)
        return metrics
    finally:
        engine.close()


def is_run_dir(path: str | Path) -> bool:
    """A training run's directory: its resolved config.yaml and a final model/ or checkpoints."""
    p = Path(path)
    return (p / "config.yaml").is_file() and (
        (p / "model").is_dir() or (p / "checkpoints").is_dir()
    )


def locate(model: str) -> tuple[Path | None, str]:
    """(the run's config.yaml or None, the HF model directory) for a run directory (its newest
    complete checkpoint, else its final model/), a checkpoint (runs/x/checkpoints/step_N; the run's
    config is two levels up), or a model directory / hub name."""
    from weir.train.export import find_model_dir

    p = Path(model)
    if not ((p / "manifest.json").is_file() or is_run_dir(p)):
        return None, model
    model_dir, origin = find_model_dir(p)
    run_dir = Path(origin["checkpoint"]).parent.parent if "checkpoint" in origin else p
    config = run_dir / "config.yaml"
    return (config if config.is_file() else None), str(model_dir)


def eval_config(
    model: str,
    *,
    task: str | None = None,
    data: Path | None = None,
    reward: str | None = None,
    n: int | None = None,
    temperature: float | None = None,
    size: int | None = None,
    max_new_tokens: int | None = None,
    seed: int | None = None,
) -> Config:
    """The config `weir eval` runs.

    `model` is a model directory, a hub name, a run directory or a checkpoint. A run directory is
    evaluated exactly as the run evaluated itself (its config.yaml: task, held-out rows, reward, eval
    sampling) on its newest checkpoint (else its final model/), and a checkpoint with its run's
    config, so greedy accuracy reproduces what the run logged at that step;
    flags given explicitly still win. Anything else gets `DEFAULTS` for the flags left out.
    """
    flags = {
        "n": n,
        "temperature": temperature,
        "size": size,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
    }
    run_config, model_path = locate(model)
    run = run_config is not None
    if not run:
        defaults = {**DEFAULTS, **TASK_DEFAULTS.get(task or "", {})}
        flags = {k: defaults[k] if v is None else v for k, v in flags.items()}
    keys = {
        "n": "eval.n",
        "temperature": "eval.temperature",
        "size": "data.eval_size",
        "max_new_tokens": "eval.max_new_tokens",
        "seed": "run.seed",
    }
    overrides = [f"{keys[k]}={v}" for k, v in flags.items() if v is not None]
    overrides += [f"model.path={model_path}", "run.steps=0"]
    if task:
        overrides.append(f"data.task={task}")
        if not run:
            overrides += TASK_OVERRIDES.get(task, [])
    if data:
        overrides += [f"data.eval_source={data}", f"data.source={data}"]
    if reward:  # the run's reward options belong to the run's reward, not to this one
        overrides += [f"reward.function={reward}", "reward.kwargs={}", "reward.components=[]"]
    return load_config(run_config, overrides)
