"""The actor's advantages under `algo.credit`: a multi-turn batch's step-wise and task-level rewards
read off its samples and combined by `weir.algo.turn_credit` (the rule and its formula are there).

A sample of a multi-turn episode (`weir.rollout.multi_turn`) carries what this needs:
``reward_info`` ``task_reward`` (the reward function's value), ``env_rewards`` (the environment's
step rewards, one per turn it was stepped on) and ``turns`` (the episode's model turns); ``metadata``
``turns`` (the model turns and observations of its response, in order, with their token counts),
``turn_offset`` (the episode's model turns before this sample: a segment's) and ``episode`` (which
episode of its group it belongs to).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from weir import algo
from weir.algo.turn_credit import (
    TOKEN_LEVEL,
    turn_credit_advantages,
    turn_token_rewards,
)
from weir.data.sample import Sample

__all__ = ["CreditInputs", "credit_inputs", "step_advantages", "uses_credit"]


@dataclass
class CreditInputs:
    """A batch's episodes and turns as tensors (see `weir.algo.turn_credit`)."""

    task_rewards: torch.Tensor  # [E]
    step_rewards: torch.Tensor  # [E, K]
    turns: torch.Tensor  # [E]
    episode_of: torch.Tensor  # [B]
    episode_group: torch.Tensor  # [E]
    turn_ids: torch.Tensor  # [B, T]
    last_segment: torch.Tensor  # [B] bool: the sample ends its episode
    last_turn: torch.Tensor  # [B] the episode turn of the sample's last model turn


def uses_credit(mode: str, samples: list[Sample]) -> bool:
    """Whether the batch needs the two-level rule: a `turn`/`both` credit mode, or episodes split
    into segments (whose statistics must count each episode once)."""
    return mode != "episode" or any(s.metadata.get("segments", 1) > 1 for s in samples)


def credit_inputs(
    samples: list[Sample], group_ids: torch.Tensor, width: int, *, task: str = "task"
) -> CreditInputs:
    """The tensors of `samples` (a batch, in order; `group_ids` their advantage groups, `width`
    the batch's response width). `task`: which reward is the episode's R_e: ``task`` (the reward
    function's, ``reward_info["task_reward"]``) or ``sample`` (the sample's reward, as
    ``agent.reward`` composed it)."""
    keys: dict[tuple[int, Any], int] = {}
    episode_of, task_rewards, steps, turns, groups = [], [], [], [], []
    turn_ids = torch.full((len(samples), width), -1, dtype=torch.long)
    last_turn = []
    for b, s in enumerate(samples):
        meta = s.metadata
        if "turns" not in meta:
            raise ValueError(
                "algo.credit.mode=turn/both needs multi-turn episodes (rollout.function "
                "weir.rollout.multi_turn:rollout, or agent.env): this sample has no turns"
            )
        key = (int(group_ids[b]), meta.get("episode", s.index))
        if key not in keys:
            keys[key] = len(keys)
            info = s.reward_info
            r = info.get("task_reward", s.reward) if task == "task" else s.reward
            task_rewards.append(float("nan") if r is None else float(r))
            n = int(info.get("turns", sum(t["role"] == "assistant" for t in meta["turns"])))
            env = [float(x) for x in info.get("env_rewards", [])][:n]
            steps.append(env + [0.0] * (n - len(env)))
            turns.append(n)
            groups.append(int(group_ids[b]))
        episode_of.append(keys[key])
        t, pos = int(meta.get("turn_offset", 0)), 0
        for part in meta["turns"]:
            if part["role"] == "assistant":
                turn_ids[b, pos : pos + part["tokens"]] = t
                t += 1
            pos += part["tokens"]
        last_turn.append(t - 1)
    k = max(turns, default=0)
    step_rewards = torch.zeros(len(turns), max(k, 1))
    for e, r in enumerate(steps):
        step_rewards[e, : len(r)] = torch.tensor(r)
    segs = [s.metadata.get("segments", 1) for s in samples]
    last = [s.metadata.get("segment", 0) == n - 1 for s, n in zip(samples, segs, strict=True)]
    return CreditInputs(
        torch.tensor(task_rewards),
        step_rewards,
        torch.tensor(turns),
        torch.tensor(episode_of),
        torch.tensor(groups),
        turn_ids,
        torch.tensor(last),
        torch.tensor(last_turn),
    )


def step_advantages(
    credit: Any,
    estimator: str | Callable[..., Any],
    samples: list[Sample],
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    token_rewards: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    options: dict[str, Any] | None = None,
) -> algo.AdvantageResult:
    """The batch's advantages under `credit` (the `algo.credit` section): the estimator as usual
    where the rule does not apply (`uses_credit`), else `weir.algo.turn_credit`'s rule for a
    sequence-level estimator, or the step rewards placed as token rewards for a token-level one."""
    options = dict(options or {})
    extra = {} if values is None else {"values": values}
    if not uses_credit(credit.mode, samples):
        return algo.compute_advantages(
            estimator, rewards, mask, group_ids, token_rewards=token_rewards, **extra, **options
        )
    name = estimator if isinstance(estimator, str) else getattr(estimator, "__name__", "")
    task = "task" if credit.mode != "episode" else "sample"
    x = credit_inputs(samples, group_ids, mask.shape[1], task=task)
    if name in TOKEN_LEVEL:
        return _token_level(
            credit, estimator, x, rewards, mask, group_ids, token_rewards, extra, options
        )
    if token_rewards is not None:
        raise ValueError(
            "algo.credit with a sequence-level estimator does not take token rewards (kl.as_reward): "
            "put the KL in the loss (algo.kl.as_reward=false)"
        )
    return turn_credit_advantages(
        estimator,
        x.task_rewards,
        x.step_rewards,
        x.turns,
        x.episode_of,
        x.episode_group,
        x.turn_ids.to(mask.device),
        mask,
        mode=credit.mode,
        weight=credit.step_weight,
        gamma=credit.step_discount,
        **options,
    )


def _token_level(credit, estimator, x, rewards, mask, group_ids, token_rewards, extra, options):
    """GAE / REINFORCE++ under the two-level rule: step rewards on each turn's last token; the
    outcome is R_e on the episode's last segment and the discounted rest of the episode on the
    others (see `weir.algo.turn_credit`)."""
    if credit.mode == "episode":  # segments: each scored with its episode's reward
        return algo.compute_advantages(
            estimator, rewards, mask, group_ids, token_rewards=token_rewards, **extra, **options
        )
    w, gamma = credit.step_weight, credit.step_discount
    both = credit.mode == "both"
    per_turn = w * x.step_rewards.clone()
    if both:
        ends = (x.turns - 1).clamp(min=0)
        per_turn[torch.arange(len(x.turns)), ends] += torch.nan_to_num(x.task_rewards)
    step_tokens = turn_token_rewards(
        x.step_rewards, x.episode_of, x.turn_ids.to(mask.device), mask, weight=w
    )
    if token_rewards is not None:
        step_tokens = step_tokens + token_rewards
    outcome = torch.zeros(len(x.episode_of))
    for b, (e, last, t_last) in enumerate(
        zip(x.episode_of.tolist(), x.last_segment.tolist(), x.last_turn.tolist(), strict=True)
    ):
        if last:
            outcome[b] = x.task_rewards[e] if both else 0.0
        else:  # the rest of the episode after this segment's last turn, discounted by turns
            rest = per_turn[e, t_last + 1 : int(x.turns[e])]
            outcome[b] = sum(gamma ** (i + 1) * float(r) for i, r in enumerate(rest))
    return algo.compute_advantages(
        estimator, outcome, mask, group_ids, token_rewards=step_tokens, **extra, **options
    )
