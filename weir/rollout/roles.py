"""Multi-agent episodes, the engine-free half: the episode a scorer sees, credit assignment, and
per-role metrics.

A multi-agent episode yields one `Sample` per role that acted (its view of the episode: its own
turns trained, the other roles' turns as context), tagged ``sample.metadata["role"]`` and
``sample.metadata["episode"]``. Everything here reads only those tags and ``reward_info``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from weir.data.sample import Group, Sample, Status

__all__ = [
    "Turn",
    "Episode",
    "Outcome",
    "credit",
    "parse_outcome",
    "role_of",
    "role_metrics",
    "episode_rewards",
]


@dataclass(frozen=True)
class Turn:
    """One turn: who acted and what it said (decoded, special tokens removed)."""

    role: str
    text: str
    num_tokens: int
    finish_reason: str = "stop"


@dataclass
class Episode:
    """What a scorer sees: the row's turns in order, and how the episode ended."""

    row: dict[str, Any]
    roles: list[str]
    turns: list[Turn] = field(default_factory=list)
    stop: str = "done"
    """``done`` (every scheduled turn taken), ``length``, ``max_tokens`` or ``abort``."""
    info: dict[str, Any] = field(default_factory=dict)
    """What the rollout recorded for the scorer, e.g. a game's own rewards per role
    (`weir.adapters.textarena`)."""

    def last(self, role: str) -> str | None:
        """The text of `role`'s last turn, or None when it never acted."""
        for t in reversed(self.turns):
            if t.role == role:
                return t.text
        return None

    @property
    def final_text(self) -> str:
        """The last turn's text (the team's answer under the default scoring)."""
        return self.turns[-1].text if self.turns else ""

    @property
    def transcript(self) -> str:
        return "\n".join(f"{t.role}: {t.text}" for t in self.turns)


@dataclass(frozen=True)
class Outcome:
    """A scored episode: the team's reward (None when the scorer gave none) and each role's own."""

    team: float | None
    roles: dict[str, float]


def parse_outcome(value: Any, roles: Iterable[str]) -> Outcome:
    """Check and convert a scorer's result: a number (the team reward) or a dict with ``team``
    and/or role names. Raises ValueError naming the problem (an unknown key, a non-number, NaN)."""
    names = set(roles)
    if isinstance(value, bool) or value is None:
        raise ValueError(f"the scorer returned {value!r}; return a number or a dict")
    if isinstance(value, (int, float)):
        return Outcome(_finite("team", value), {})
    if not isinstance(value, dict):
        raise ValueError(
            f"the scorer returned {type(value).__name__}; return a number or "
            '{"team": float, "<role>": float, ...}'
        )
    unknown = sorted(set(value) - names - {"team"})
    if unknown:
        raise ValueError(
            f"the scorer returned keys {unknown}: neither 'team' nor a role in {sorted(names)}"
        )
    team = _finite("team", value["team"]) if value.get("team") is not None else None
    return Outcome(team, {k: _finite(k, v) for k, v in value.items() if k != "team"})


def _finite(key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"the scorer's {key!r} reward must be a finite number, got {v!r}")
    return float(v)


def credit(outcome: Outcome, role: str, mode: str, team_weight: float = 0.5) -> float:
    """The reward role `role`'s sample is trained on.

    ``team``: r = T; ``role``: r = R_role; ``mixed``: r = w * T + (1 - w) * R_role, with T the team
    reward, R_role the role's own and w = `team_weight`. Raises ValueError when a needed part is
    missing (the sample then fails, counted, instead of training on a made-up number).
    """
    need_team, need_role = mode in ("team", "mixed"), mode in ("role", "mixed")
    if need_team and outcome.team is None:
        raise ValueError(f"multi_agent.credit={mode} needs a team reward; the scorer gave none")
    if need_role and role not in outcome.roles:
        raise ValueError(
            f"multi_agent.credit={mode} needs role {role!r}'s own reward; the scorer gave none"
        )
    if mode == "team":
        return outcome.team
    if mode == "role":
        return outcome.roles[role]
    if mode == "mixed":
        return team_weight * outcome.team + (1.0 - team_weight) * outcome.roles[role]
    raise ValueError(f"unknown multi_agent.credit {mode!r}: team, role or mixed")


def role_of(sample: Sample) -> str | None:
    """The role whose view `sample` is, or None for a single-agent sample."""
    return sample.metadata.get("role")


def role_metrics(samples: list[Sample]) -> dict[str, float]:
    """Per-role step metrics: ``reward/<role>/mean|std`` (the credited reward it trains on),
    ``reward/<role>/own_mean`` (the scorer's role reward, where given), ``response/<role>/length_mean``,
    ``rollout/<role>/samples``, and ``reward/team/mean`` over episodes. Empty without roles."""
    by_role: dict[str, list[Sample]] = {}
    for s in samples:
        role = role_of(s)
        if role is not None:
            by_role.setdefault(role, []).append(s)
    if not by_role:
        return {}
    out: dict[str, float] = {}
    for role, ss in by_role.items():
        rewards = [s.reward for s in ss if s.reward is not None]
        own = [s.reward_info["role_reward"] for s in ss if "role_reward" in s.reward_info]
        out[f"reward/{role}/mean"] = statistics.fmean(rewards) if rewards else float("nan")
        out[f"reward/{role}/std"] = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
        if own:
            out[f"reward/{role}/own_mean"] = statistics.fmean(own)
        out[f"response/{role}/length_mean"] = statistics.fmean(sum(s.loss_mask) for s in ss)
        out[f"rollout/{role}/samples"] = float(len(ss))
    team = {
        (s.group_id, s.metadata.get("episode")): s.reward_info["team_reward"]
        for s in samples
        if s.reward_info.get("team_reward") is not None
    }
    if team:
        out["reward/team/mean"] = statistics.fmean(team.values())
    return out


def episode_rewards(group: Group) -> list[float] | None:
    """One reward per episode of a multi-agent group (the team reward; without one, the mean of
    its roles' credited rewards; 0 for a failed episode), or None for a single-agent group."""
    episodes: dict[Any, list[Sample]] = {}
    for s in group.samples:
        if role_of(s) is None:
            return None
        episodes.setdefault(s.metadata.get("episode"), []).append(s)
    out = []
    for ss in episodes.values():
        team = ss[0].reward_info.get("team_reward")
        rewards = [s.reward for s in ss if s.reward is not None and s.status != Status.FAILED]
        if team is not None:
            out.append(float(team))
        else:
            out.append(statistics.fmean(rewards) if rewards else 0.0)
    return out
