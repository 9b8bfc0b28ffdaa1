"""Sharded trainer checkpoints: every rank writes and reads its own part, with DCP.

A run checkpoint of a Ray run (weir.loop.checkpointing) holds the trainer in ``trainer/``, a
`torch.distributed.checkpoint` directory: ``__<rank>_<i>.distcp`` written by each rank in
parallel (its shards of the weights and of the optimizer state, nothing gathered), and
``.metadata`` (rank 0: which slice of which tensor is in which file). Next to it, ``model/`` holds
the HF config and tokenizer without weights, so `export_sharded` can turn the checkpoint into an
HF directory offline, on any machine, without the cluster.

Each rank hashes the files it wrote (`save_shards` returns their manifest entries), so the
manifest of an N-rank checkpoint is hashed N files at a time. Loading reshards: a checkpoint
written by N ranks loads into M ranks, or into one process (`load_shards` with no process group).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from weir.train.checkpoint import hash_files

TRAINER_DIR = "trainer"
MODEL_DIR = "model"


def actor_state(actor: Any) -> dict[str, Any]:
    """What DCP saves of an `Actor` (sharded or not), and the template it loads into: model and
    optimizer (this rank's shards), schedule, KL coefficient, update counters."""
    model_sd, optim_sd = get_state_dict(actor.model, actor.optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "scheduler": actor.scheduler.state_dict(),
        "kl_coef": float(actor.kl_ctl.value),
        "updates": int(actor.updates),
        "skipped_updates": int(actor.skipped_updates),
    }


def critic_state(critic: Any) -> dict[str, Any]:
    """What DCP saves of a `Critic` (sharded or not): its value model and optimizer (this rank's
    shards), schedule and counters."""
    model_sd, optim_sd = get_state_dict(critic.model, critic.optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "scheduler": critic.scheduler.state_dict(),
        "steps": int(critic.steps),
        "updates": int(critic.updates),
        "skipped_updates": int(critic.skipped_updates),
    }


def rank_state(policies: Any, critics: dict[str, Any] | None = None) -> dict[str, Any]:
    """What DCP saves of a rank: its policy (`actor_state`, the keys of a run with one policy), or
    ``roles: {role: ...}`` with separate policies; each with its critic under ``critic``."""
    critics = critics or {}
    if not isinstance(policies, dict):
        policies = {"": policies}

    def one(role: str) -> dict[str, Any]:
        state = actor_state(policies[role])
        if role in critics:
            state["critic"] = critic_state(critics[role])
        return state

    if list(policies) == [""]:
        return one("")
    return {"roles": {role: one(role) for role in policies}}


def save_shards(
    actor: Any, path: str | Path, rank: int, critics: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """Collective: every rank writes its shards (of `actor`, an `Actor` or {role: actor}, and of
    its `critics`) into `path` (fsynced); returns the manifest entries of the files this rank
    wrote, keyed relative to `path`'s parent (the checkpoint directory)."""
    path = Path(path)
    dcp.save(rank_state(actor, critics), checkpoint_id=str(path))
    return hash_files(sorted(path.glob(f"__{rank}_*.distcp")), path.parent)


def load_shards(actor: Any, path: str | Path, critics: dict[str, Any] | None = None) -> None:
    """Read what `save_shards` wrote into `actor` (and `critics`): each rank reads the slices it
    holds; without a process group one process reads everything."""
    state = rank_state(actor, critics)
    with warnings.catch_warnings():  # without a process group: one process reads everything
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(Path(path)))
    policies = actor if isinstance(actor, dict) else {"": actor}
    parts = state.get("roles", {"": state})
    for role, a in policies.items():
        _put_actor(a, parts[role])
        if critics and role in critics:
            _put_critic(critics[role], parts[role]["critic"])


def _put_actor(actor: Any, state: dict[str, Any]) -> None:
    set_state_dict(
        actor.model,
        actor.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    actor.scheduler.load_state_dict(state["scheduler"])
    actor.kl_ctl.value = state["kl_coef"]
    actor.updates, actor.skipped_updates = int(state["updates"]), int(state["skipped_updates"])


def _put_critic(critic: Any, state: dict[str, Any]) -> None:
    set_state_dict(
        critic.model,
        critic.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    critic.scheduler.load_state_dict(state["scheduler"])
    critic.steps, critic.updates = int(state["steps"]), int(state["updates"])
    critic.skipped_updates = int(state["skipped_updates"])


def is_sharded(checkpoint: str | Path) -> bool:
    """A run checkpoint whose trainer state is DCP shards (a Ray run's), not an HF `model/`."""
    return (Path(checkpoint) / TRAINER_DIR / ".metadata").is_file()


def save_model_files(model: Any, tokenizer: Any, out: str | Path) -> Path:
    """The HF directory minus the weights: config, generation config, tokenizer."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def export_sharded(checkpoint: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write the weights of a sharded checkpoint as an HF directory at `out`, in one process.

    The model is built from ``model/config.json`` and its tensors are read from the shards (DCP
    reshards N ranks' slices into whole tensors); memory is one copy of the model, in float32 (or
    `dtype`). What is written is loaded back by `from_pretrained` in `export_model`'s check.
    """
    from transformers import AutoTokenizer

    from weir.config.devices import DTYPES
    from weir.train.meta_init import build_on_meta, materialize
    from weir.train.model import save_model

    ckpt = Path(checkpoint)
    model = build_on_meta(str(ckpt / MODEL_DIR), DTYPES[dtype or "float32"])
    materialize(model, "cpu")
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt / TRAINER_DIR), no_dist=True)
    model.load_state_dict(state["model"])
    model.config.use_cache = True  # training switches the KV cache off; generation wants it
    tokenizer = AutoTokenizer.from_pretrained(ckpt / MODEL_DIR)
    return save_model(model, tokenizer, out)
