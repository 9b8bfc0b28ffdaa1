"""vLLM / SGLang servers for a run in one process (`cluster.type=local`): child processes of this
one, or attached by `engine.urls`; and one role's engine with separate policies. (On Ray the
cluster places them: weir.loop.ray_build.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from weir.config import Config
from weir.config.devices import resolve_device, resolve_dtype
from weir.train.model import eos_token_ids


def engine_placement(cfg: Config, model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """The built-in engine's device and dtype: `engine.device` (auto: the trainer model's device)
    and `engine.dtype` (auto: bfloat16 on CUDA, float32 on CPU)."""
    p = next(model.parameters())
    if cfg.engine.device == "auto":
        device = p.device
    else:
        device = resolve_device(cfg.engine.device, key="engine.device")
    return device, resolve_dtype(cfg.engine.dtype, device)


def server_engine(
    cfg: Config,
    model: torch.nn.Module,
    tokenizer: Any,
    model_path: str,
    run_dir: Path,
    role: str = "",
    share: tuple[int, int] = (0, 1),
) -> Any:
    """vLLM / SGLang servers of one policy as child processes of this one (or attached: group
    `share[0]` of `share[1]` takes its equal share of `engine.urls`, in role order)."""
    from weir.engine.remote import start_engine_servers

    index, groups = share
    per = len(cfg.engine.urls) // groups
    urls = cfg.engine.urls[index * per : (index + 1) * per]
    lora = cfg.lora
    return start_engine_servers(
        cfg.engine.model_copy(update={"urls": urls}),
        model_path,
        run_dir / "engine" / role if role else run_dir / "engine",
        eos_token_ids(model, tokenizer),
        dtype=str(engine_placement(cfg, model)[1]).removeprefix("torch."),
        seed=cfg.run.seed,
        lora_rank=lora.rank if lora.enabled and lora.sync == "adapter" else None,
    )


def policy_engine(
    cfg: Config,
    model: torch.nn.Module,
    tokenizer: Any,
    path: str,
    role: str,
    *,
    run_dir: Path,
    make_engine: Any,
) -> Any:
    """One role's engine (multi_agent.policies=separate, one process): the built-in engine on its
    model, or its own vLLM / SGLang servers; attached servers are given the role's weights."""
    if cfg.engine.type == "torch":
        return make_engine(cfg, model, tokenizer)
    names = [r.name for r in cfg.multi_agent.roles]
    engine = server_engine(
        cfg, model, tokenizer, path, run_dir, role, (names.index(role), len(names))
    )
    if cfg.engine.urls:
        from weir.train.lora import is_lora, merged_weights

        weights = merged_weights(model) if is_lora(model) else model.named_parameters()
        engine.update_weights_sync(weights, 0)
    return engine
