"""multi_agent.policies=separate on the local cluster: a model, an `Actor` and a built-in engine per
role, built from the run's config and handed to the loops as one trainer (`RoleTrainer`) and one
engine (`RoleRouter`).

Why facades rather than a loop of its own: the loops (sync, async), the producer, evaluation,
checkpointing and resumption already do the right thing with one trainer and one engine; the
facades keep them unchanged. The trainer splits each batch by role, the router sends each turn to
its role's engine, weights go to each role's engine under the one version counter.

Every role starts from `model.path` (or its `multi_agent.roles[i].model_path`), which must share
the run's tokenizer: the views are encoded once, with that tokenizer, and each role's turns are
re-read as text by the others. Memory: each role holds its own weights, optimizer state (and
reference, with KL) and KV cache, so the trainer side costs about the number of roles times a
shared policy's (docs/multi-agent.md measures it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weir.config import Config
from weir.config.devices import resolve_device
from weir.engine.role_router import RoleRouter
from weir.engine.support import check_model_path, model_support
from weir.train.actor import Actor, ActorSettings
from weir.train.model import load_model, resolve_model_path, save_model
from weir.train.precision import Precision
from weir.train.role_trainer import RoleTrainer


@dataclass
class RolePolicies:
    """The per-role pieces: models (the trainers' modules), the trainer and the engine facades."""

    models: dict[str, torch.nn.Module]
    trainer: RoleTrainer
    engine: RoleRouter

    def save_models(self, out: Path, tokenizer: Any) -> Path:
        """Each role's current weights as an HF directory ``<out>/<role>/`` (LoRA merged, and the
        adapter alone in ``<out>/<role>/adapter``); returns `out`."""
        from weir.train.lora import is_lora, merged_model

        for role, model in self.models.items():
            if is_lora(model):
                save_model(model, tokenizer, out / role / "adapter")
                plain = merged_model(model)
                plain.config.use_cache = True
                save_model(plain, tokenizer, out / role)
            else:
                save_model(model, tokenizer, out / role)
        return out


def role_model_path(cfg: Config, run_dir: Path, role: Any) -> str:
    """The directory role `role` starts from: its `model_path`, else `model.path` (a `tiny:` model
    is built next to the run directory once, as for the run's own)."""
    path = role.model_path or cfg.model.path
    if not path.startswith("tiny:"):
        check_model_path(path)
    return resolve_model_path(
        path, run_dir.parent / ".models", arch=cfg.model.arch, seed=cfg.model.init_seed
    )


def build_role_policies(
    cfg: Config,
    run_dir: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    base_path: str,
    make_engine: Any,
    selfcheck: Any = None,
) -> RolePolicies:
    """A model, `Actor` (a `LoraActor` with lora.enabled), critic (algo.advantage=gae) and
    engine per role of ``cfg.multi_agent.roles``.

    `model` (loaded from `base_path`) becomes the first role's that starts from there; the others
    load their own copy. `make_engine(cfg, model, tokenizer, path, role)` builds one role's engine
    (role k's engine seeded with run.seed + k, so two roles' unseeded requests draw different
    streams);
    `selfcheck(model, engine, train_cfg)` probes each distinct model once. A model whose tokenizer
    differs from the run's is refused with the role's name. Engines already started are closed
    when a later role fails."""
    device = resolve_device(cfg.train.device, key="train.device")
    precision = Precision.from_config(cfg.train, device=device)
    settings = ActorSettings.from_config(cfg)
    models: dict[str, torch.nn.Module] = {}
    actors: dict[str, Actor] = {}
    critics: dict[str, Any] = {}
    engines: dict[str, Any] = {}
    checked: set[str] = set()
    try:
        for k, role in enumerate(cfg.multi_agent.roles):
            path = role_model_path(cfg, run_dir, role) if role.model_path else base_path
            if path == base_path and not any(m is model for m in models.values()):
                role_model = model
            else:
                role_model, role_tok = load_model(path, precision.param_dtype, precision.device)
                _check_tokenizer(role.name, path, role_tok, tokenizer)
                model_support(role_model.config)
            if cfg.lora.enabled:  # adapters on this role's model (weir.train.lora)
                from weir.train.lora import LoraActor, apply_lora

                role_model = apply_lora(role_model, cfg.lora, base_path=path, seed=cfg.run.seed)
                actors[role.name] = LoraActor(role_model, settings)
            else:
                actors[role.name] = Actor(role_model, settings)
            models[role.name] = role_model
            if cfg.algo.advantage == "gae":
                critics[role.name] = role_critic(cfg, role_model, run_dir)
            seeded = cfg.model_copy(
                update={"run": cfg.run.model_copy(update={"seed": cfg.run.seed + k})}
            )
            engines[role.name] = make_engine(seeded, role_model, tokenizer, path, role.name)
            if selfcheck is not None and path not in checked:
                selfcheck(role_model, engines[role.name], cfg.train)
                checked.add(path)
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    offload = {
        r: cfg.engine.sleep_offload_weights and getattr(e, "model", None) is not models[r]
        for r, e in engines.items()
    }
    router = RoleRouter(
        engines, sleep_while_training=cfg.engine.sleep_while_training, offload_weights=offload
    )
    return RolePolicies(models=models, trainer=RoleTrainer(actors, critics), engine=router)


def role_critic(cfg: Config, model: torch.nn.Module, run_dir: Path) -> Any:
    """A role's critic (algo.advantage=gae), made as a run with one policy makes its own."""
    from weir.loop.components import policy_critic

    return policy_critic(cfg, model, run_dir)


def _check_tokenizer(role: str, path: str, tok: Any, run_tok: Any) -> None:
    if tok.get_vocab() != run_tok.get_vocab() or tok.eos_token_id != run_tok.eos_token_id:
        raise ValueError(
            f"multi_agent.roles[{role}].model_path={path} has another tokenizer than model.path; "
            "the roles read each other's turns with one tokenizer: use models that share it"
        )


def eval_engines(cfg: Config, make_engine: Any) -> tuple[RoleRouter, Any]:
    """`weir eval` of a run with separate policies: an engine per role on ``<model.path>/<role>``
    (a run's or checkpoint's ``model/``), or on `model.path` itself for every role when it is one
    model (the policies before training). Returns the router and the tokenizer."""
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    base = Path(cfg.model.path)
    device = resolve_device(cfg.train.device, key="train.device")
    dtype = Precision.from_config(cfg.train, device=device).param_dtype
    engines: dict[str, Any] = {}
    tokenizer = None
    try:
        for role in cfg.multi_agent.roles:
            own = base / role.name
            path = str(own) if (own / "config.json").exists() else cfg.model.path
            model, tok = load_model(path, dtype, device)
            if tokenizer is None:
                tokenizer = tok
            else:
                _check_tokenizer(role.name, path, tok, tokenizer)
            engines[role.name] = make_engine(cfg, model.eval(), tok, path, role.name)
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    return RoleRouter(engines), tokenizer
