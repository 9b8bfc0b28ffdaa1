"""What a run checkpoint holds, and putting it back.

``<run dir>/checkpoints/step_N/`` (written atomically by weir.train.checkpoint):

- ``model/``: the policy as a standard HF directory (safetensors, config, tokenizer): `weir export`
  copies it, and resuming loads its tensors into the trainer's model; with
  multi_agent.policies=separate one such directory per role, ``model/<role>/``;
- ``trainer.pt``: optimizer and LR-schedule state, the KL coefficient, update counters;
- ``critic/`` (PPO with a critic): ``model.safetensors``, the value model's weights (only the value
  head when it shares the policy's backbone), and ``state.pt``, its optimizer, schedule, counters;
- ``rng.pt``: Python, NumPy, torch CPU and CUDA RNG states and the engine's seed stream;
- ``state.json``: step, weight version, data-iterator position, the evaluations so far;
- ``buffer.pt`` (asynchronous loop): groups generated but not yet trained, and the rows still being
  generated, which are rolled out again on resume so no prompt is lost.

On Ray (`cluster.type=ray`) the trainer is sharded and so is its checkpoint: ``trainer/`` holds
every rank's DCP shards of weights and optimizer state, written and hashed by the ranks in
parallel, and ``model/`` only the config and tokenizer (weir.train.sharded_checkpoint). Nothing
passes through the driver, and on resume each rank reads its own shards back. `weir export`
turns either kind into an HF directory.

With these, a sync run killed at any point and resumed from its newest checkpoint continues exactly
as if it had not been stopped (tests/loop/test_resume.py kills runs and compares metrics).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from weir.train.checkpoint import read_manifest, write_checkpoint
from weir.train.model import save_model
from weir.train.sharded_checkpoint import (
    MODEL_DIR,
    TRAINER_DIR,
    is_sharded,
    load_shards,
    save_model_files,
)

if TYPE_CHECKING:
    from weir.loop.components import Components
    from weir.loop.run import Run


def save_run_checkpoint(
    run: Run, parts: Components, step: int, buffer: dict[str, Any] | None = None
) -> Path:
    """Write checkpoint `step` of `run` (keeping run.keep_checkpoints) and return its directory."""

    sharded = getattr(parts, "cluster", None) is not None

    def write(tmp: Path) -> dict[str, Any]:
        hashed: dict[str, Any] = {}
        if sharded:  # every rank writes (and hashes) its own shards; the driver holds none
            hashed = parts.trainer.save(tmp / TRAINER_DIR)
            save_model_files(parts.model, parts.tokenizer, tmp / MODEL_DIR)
        else:
            for sub, model in parts.policy_models().items():  # sub: "" or a role's name
                save_model(model, parts.tokenizer, tmp / MODEL_DIR / sub)
            torch.save(parts.trainer.state_dict(), tmp / "trainer.pt")
        if getattr(parts, "critic", None) is not None:
            parts.critic.save(tmp / "critic")
        torch.save(
            {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "engine": parts.engine.state_dict()
                if hasattr(parts.engine, "state_dict")
                else None,
            },
            tmp / "rng.pt",
        )
        if buffer is not None:
            torch.save(buffer, tmp / "buffer.pt")
        state = {
            "step": step,
            "version": run.version,
            "prompts": buffer["prompts"] if buffer else parts.prompts.state_dict(),
            "evals": run.evals,
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        return hashed

    return write_checkpoint(
        run.dir / "checkpoints",
        step,
        write,
        meta={"version": run.version, "run": run.cfg.run.name},
        keep=run.cfg.run.keep_checkpoints,
    )


def load_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Load the weights of an HF directory into `model` in place.

    They are read through `from_pretrained`, i.e. transformers' own key renaming and weight
    conversion, so a checkpoint saved by `save_pretrained` comes back as the module holds it (e.g.
    Qwen3-MoE's experts: one tensor per expert on disk, fused in memory). Every parameter and buffer
    of `model` must be found, with its shape.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    from weir.train.lora import is_adapter_dir, is_lora, load_adapter

    if is_adapter_dir(model_dir) or is_lora(model):  # a LoRA run's checkpoint holds its adapter
        return load_adapter(model, model_dir)
    vision = getattr(getattr(model, "config", None), "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    if not sorted(model_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    dtype = next(model.parameters()).dtype
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        loaded = auto.from_pretrained(model_dir, dtype=dtype)
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint {model_dir} cannot be loaded: {err}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    state = loaded.state_dict()
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or shapes:
        raise ValueError(
            f"checkpoint {model_dir} does not fit this model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, other shapes {shapes[:5]}; was model.path changed?"
        )
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])


def restore_run_checkpoint(path: Path, run: Run, parts: Components) -> dict[str, Any] | None:
    """Load checkpoint `path` into the run and its components; returns the saved buffer, if any."""
    state = json.loads((path / "state.json").read_text())
    on_ray = getattr(parts, "cluster", None) is not None
    if is_sharded(path):
        if on_ray:  # each rank reads its own shards (DCP reshards to this many ranks)
            parts.trainer.load(str(path / TRAINER_DIR))
        else:  # a Ray run's checkpoint continued in one process
            load_shards(parts.trainer, path / TRAINER_DIR)
    elif on_ray:  # a one-process run's checkpoint continued on Ray: each rank reads its slices
        parts.trainer.call("load_hf", str(path / MODEL_DIR))
        parts.trainer.load_state_dict(torch.load(path / "trainer.pt", weights_only=False))
    else:
        for sub, model in parts.policy_models().items():
            load_weights(model, path / MODEL_DIR / sub)
        parts.trainer.load_state_dict(torch.load(path / "trainer.pt", weights_only=False))
    if getattr(parts, "critic", None) is not None:
        parts.critic.load(path / "critic")
    parts.prompts.load_state_dict(state["prompts"])
    rng = torch.load(path / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    restore_cuda_rng(rng.get("cuda"))
    run.version, run.last_step = state["version"], state["step"]
    run.evals = state["evals"]
    if getattr(parts, "sync", None) is not None:  # Ray: from the ranks' shards to the replicas
        parts.sync.push(run.version)
    else:
        asyncio.run(parts.engine.update_weights(parts.trainer.weights(), run.version))
    if rng["engine"] is not None and hasattr(parts.engine, "load_state_dict"):
        parts.engine.load_state_dict(rng["engine"])
    buffer = path / "buffer.pt"
    return torch.load(buffer, weights_only=False) if buffer.exists() else None


def restore_cuda_rng(states: list[torch.Tensor] | None) -> None:
    """Put back the CUDA generators' states saved by a checkpoint (one per visible device).

    A checkpoint written without CUDA (None) leaves them alone; one resumed on a machine with
    fewer devices restores those it has.
    """
    if not states or not torch.cuda.is_available():
        return
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, index)


def checkpoint_step(path: Path) -> int:
    return int(read_manifest(path)["step"])
