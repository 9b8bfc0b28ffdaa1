"""One trainer per role behind one trainer: multi_agent.policies=separate.

A step's `TrainBatch` holds the views of every role (`metadata["role"]`). `RoleTrainer.train`
splits it by role and trains each role's `Actor` on its own rows only, so a policy's loss, its
advantages (GRPO's groups are already per (prompt, role)), its loss normaliser (e.g. token-mean over
*its* tokens) and its optimizer step never see another policy's tokens. A role with no trainable
view in the batch is not stepped at all (its weights, optimizer and schedule stay as they are).

Metrics: each actor's keys once per role with the role after the first component
(``train/loss`` -> ``train/<role>/loss``), plus the usual aggregate keys the loop, console and
report read: times and counts summed (the actors train one after the other), throughput over the
summed time, anything with ``max`` / ``min`` in its name the maximum / minimum, the rest the mean
weighted by each role's trained tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from weir.config.episode_sections import ROLE_SEP
from weir.train.batch import TrainBatch

COUNTERS = (
    "train/skipped_updates",
    "train/skipped_steps",
    "train/nonfinite_logprob_samples",
    "train/empty_steps",
    "adv/groups",
    "adv/singleton_groups",
    "adv/zero_std_groups",
    "adv/nonfinite_rewards",
    "adv/excluded_tokens",
)
"""Aggregate keys that count things: summed over the roles."""


def select_rows(batch: TrainBatch, rows: list[int]) -> TrainBatch:
    """The batch of `rows` alone, its per-token tensors cut to their longest response: what
    `make_batch` gives for those samples (group ids keep their values; estimators only compare them).
    Step-level `metrics` are not carried over."""
    idx = torch.tensor(rows, dtype=torch.long)
    samples = [batch.samples[i] for i in rows]
    width = max(len(s.response_ids) for s in samples)

    def take(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, idx.to(t.device))[:, :width]

    return TrainBatch(
        samples=samples,
        response_mask=take(batch.response_mask),
        rollout_logprobs=take(batch.rollout_logprobs),
        versions=take(batch.versions),
        rewards=batch.rewards.index_select(0, idx.to(batch.rewards.device)),
        group_ids=batch.group_ids.index_select(0, idx.to(batch.group_ids.device)),
        behavior_logprobs=None
        if batch.behavior_logprobs is None
        else take(batch.behavior_logprobs),
    )


def rows_by_role(batch: TrainBatch, roles: list[str]) -> dict[str, list[int]]:
    """Row indices of each role's views; a sample of no known role raises ValueError."""
    out: dict[str, list[int]] = {r: [] for r in roles}
    for i, s in enumerate(batch.samples):
        role = s.metadata.get("role")
        if role not in out:
            raise ValueError(
                f"multi_agent.policies=separate: a sample of role {role!r} has no policy (roles "
                f"{roles}); the rollout must tag each view with metadata['role']"
            )
        out[role].append(i)
    return out


def role_key(key: str, role: str) -> str:
    """``train/loss`` -> ``train/<role>/loss``."""
    head, sep, rest = key.partition("/")
    return f"{head}/{role}/{rest}" if sep else f"{role}/{key}"


def aggregate(per_role: dict[str, dict[str, float]], tokens: dict[str, float]) -> dict[str, float]:
    """The aggregate of the roles' metrics (rules in the module docstring)."""
    out: dict[str, float] = {}
    keys = dict.fromkeys(k for stats in per_role.values() for k in stats)
    for k in keys:
        have = {r: s[k] for r, s in per_role.items() if k in s}
        if k.startswith("time/") or k in COUNTERS:
            out[k] = sum(have.values())
        elif k.startswith("throughput/"):
            times = {r: per_role[r].get("time/train", 0.0) for r in have}
            total = sum(times.values())
            out[k] = sum(v * times[r] for r, v in have.items()) / total if total > 0 else 0.0
        elif "max" in k:
            out[k] = max(have.values())
        elif "min" in k:
            out[k] = min(have.values())
        else:
            weights = {r: tokens.get(r, 0.0) for r in have}
            total = sum(weights.values())
            if total > 0:
                out[k] = sum(v * weights[r] for r, v in have.items()) / total
            else:
                out[k] = sum(have.values()) / len(have)
    return out


class RoleTrainer:
    """The trainer of a run with separate policies: a dict of role -> `Actor` (each with its own
    model, optimizer, schedule and reference) behind the one-trainer interface the loops use;
    with algo.advantage=gae, `critics` gives each role's policy its own critic."""

    def __init__(self, actors: dict[str, Any], critics: dict[str, Any] | None = None) -> None:
        if not actors:
            raise ValueError("RoleTrainer needs at least one role's actor")
        bad = [r for r in actors if ROLE_SEP in r]
        if bad:
            raise ValueError(f"role names may not contain {ROLE_SEP!r}: {bad}")
        self.actors = dict(actors)
        self.critics = dict(critics or {})

    @property
    def roles(self) -> list[str]:
        return list(self.actors)

    def train(self, batch: TrainBatch, critic: Any = None) -> dict[str, float]:
        """One RL step: each role's actor trains on that role's rows only (roles with none are not
        stepped). Returns per-role metrics and their aggregate."""
        if critic is not None:
            raise ValueError(
                "multi_agent.policies=separate: each role's critic is the RoleTrainer's own "
                "(critics=), not one passed to train"
            )
        per_role: dict[str, dict[str, float]] = {}
        tokens: dict[str, float] = {}
        stats: dict[str, float] = {}
        for role, rows in rows_by_role(batch, self.roles).items():
            stats[f"train/{role}/samples"] = float(len(rows))
            if not rows:
                continue
            sub = select_rows(batch, rows)
            tokens[role] = float(sub.response_mask.sum().item())
            per_role[role] = self.actors[role].train(sub, critic=self.critics.get(role))
            stats.update({role_key(k, role): v for k, v in per_role[role].items()})
        return {**aggregate(per_role, tokens), **stats}

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every role's named parameters as ``"<role>/<name>"`` (`weir.engine.role_router`)."""
        for role, actor in self.actors.items():
            for name, tensor in actor.weights():
                yield f"{role}{ROLE_SEP}{name}", tensor

    def state_dict(self) -> dict[str, Any]:
        """Each role's optimizer, schedule, KL coefficient and counters (and its critic's whole
        state: weights, optimizer, schedule, counters)."""
        state: dict[str, Any] = {"roles": {r: a.state_dict() for r, a in self.actors.items()}}
        if self.critics:
            state["critics"] = {r: c.state_dict() for r, c in self.critics.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        roles = state.get("roles")
        if roles is None or sorted(roles) != sorted(self.actors):
            raise ValueError(
                f"checkpoint holds trainer state for roles {sorted(roles or [])}, this run has "
                f"{self.roles}: was multi_agent.roles or multi_agent.policies changed?"
            )
        for r, s in roles.items():
            self.actors[r].load_state_dict(s)
        for r, c in self.critics.items():
            if r not in state.get("critics", {}):
                raise ValueError(
                    f"checkpoint holds no critic state for role {r!r} (written by a run without "
                    "algo.advantage=gae?); set run.resume=never to start over"
                )
            c.load_state_dict(state["critics"][r])
