"""Rewards at two levels: a step-wise (action-level) reward for each turn of a multi-turn episode and a
task-level (episode) reward, combined into per-token advantages.

Notation: episode ``e`` of group ``g`` (the episodes of one prompt) has turns ``t = 0 .. T_e - 1``
with step rewards ``r_{e,t}`` (from the environment) and a task reward ``R_e`` (from the reward
function). A training sample holds the tokens of one episode, or of one segment of it (when image
memory rewrote the context, `weir.rollout.vision_episode`); ``turn_ids`` says which turn each of
its trained tokens belongs to.

Sequence-level estimators (``grpo``, ``rloo``, or any estimator of that signature whose advantage is
one number per sample) are applied at two levels, each over the group:

    episode term   A^E_e     = estimator({R_e'} over the episodes e' of g)[e]
    return to go   G_{e,t}   = sum_{t' >= t} gamma^(t' - t) r_{e,t'}
    turn term      A^S_{e,t} = estimator({G_{e',t'}} over every turn t' of every episode e' of g)[(e, t)]

and every trained token of turn t of episode e gets

    mode "turn":  A_{e,t} = A^S_{e,t}
    mode "both":  A_{e,t} = A^E_e + w * A^S_{e,t}

For GRPO that is ``A^E_e = (R_e - mean_g R) / (std_g R + eps)`` and
``A^S_{e,t} = (G_{e,t} - mean_g G) / (std_g G + eps)``, the mean and std over all the turns of the
group's episodes: the episode-level and step-level relative advantages added as in GiGPO (Feng et al.
2025, ``A = A^E + w A^S``), with the step level grouped by the prompt rather than by identical
states. Statistics run over episodes, never over samples, so an episode split into segments counts
once. With one turn per episode (the single-step stage of Mobile-R1, Gu et al. 2025), ``turn`` is
GRPO on the action-level reward.

Token-level estimators (``gae``: PPO with a critic; ``reinforce_pp``, ``reinforce_pp_baseline``)
take the rewards where they happen: ``w * r_{e,t}`` on the last token of turn t (`turn_token_rewards`)
and, under ``both``, ``R_e`` on the episode's last trained token; the estimator's own discount and
(for GAE) the critic's values do the credit assignment. A segment that is not the episode's last ends
with the discounted rest of the episode, ``sum_{t > t_last} gamma^(t - t_last) r'_{e,t}`` with
``r'_{e,t} = w r_{e,t} + [both][t = T_e - 1] R_e``, as its outcome (a Monte Carlo tail).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .advantages import AdvantageResult, compute_advantages

__all__ = [
    "SEQUENCE_LEVEL",
    "TOKEN_LEVEL",
    "episode_advantages",
    "returns_to_go",
    "turn_credit_advantages",
    "turn_token_rewards",
]

SEQUENCE_LEVEL = ("grpo", "rloo")
TOKEN_LEVEL = ("gae", "reinforce_pp", "reinforce_pp_baseline")
MODES = ("episode", "turn", "both")


def returns_to_go(step_rewards: Tensor, turns: Tensor, gamma: float) -> Tensor:
    """``G_{e,t} = sum_{t' >= t} gamma^(t' - t) r_{e,t'}`` for ``t < turns[e]`` (0 beyond).
    `step_rewards` [E, K] (entries at ``t >= turns[e]`` are ignored), `turns` [E]."""
    e, k = step_rewards.shape
    valid = torch.arange(k, device=step_rewards.device)[None] < turns[:, None]
    r = torch.where(valid, step_rewards, torch.zeros_like(step_rewards))
    out = torch.zeros_like(r)
    running = torch.zeros(e, dtype=r.dtype, device=r.device)
    for t in range(k - 1, -1, -1):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return torch.where(valid, out, torch.zeros_like(out))


def episode_advantages(
    estimator: str | Callable[..., Any],
    rewards: Tensor,
    group_ids: Tensor,
    **options: Any,
) -> tuple[Tensor, dict[str, float]]:
    """One advantage per item (episode, or (episode, turn)) from a sequence-level `estimator`
    over the items' `rewards` [N] grouped by `group_ids` [N]: the estimator run on one-token rows."""
    mask = torch.ones(rewards.shape[0], 1, dtype=torch.bool, device=rewards.device)
    res = compute_advantages(estimator, rewards, mask, group_ids, **options)
    if res.advantages.shape != (rewards.shape[0], 1):
        raise ValueError(
            "algo.credit: the advantage estimator must give one advantage per sample (a "
            f"sequence-level estimator such as {', '.join(SEQUENCE_LEVEL)})"
        )
    return res.advantages[:, 0], res.metrics


def turn_credit_advantages(
    estimator: str | Callable[..., Any],
    task_rewards: Tensor,
    step_rewards: Tensor,
    turns: Tensor,
    episode_of: Tensor,
    episode_group: Tensor,
    turn_ids: Tensor,
    mask: Tensor,
    *,
    mode: str = "both",
    weight: float = 1.0,
    gamma: float = 1.0,
    **options: Any,
) -> AdvantageResult:
    """Per-token advantages of a sequence-level `estimator` under the two-level rule (module
    docstring).

    Args:
        task_rewards: [E] the task reward R_e of each episode (NaN/inf excludes the episode).
        step_rewards: [E, K] r_{e,t}; turns: [E] T_e, the turns of each episode.
        episode_of: [B] the episode of each sample; episode_group: [E] the group of each episode.
        turn_ids: [B, T] the episode turn of each token (read only where `mask` is 1).
        mask: [B, T] trained tokens.
        mode: ``episode`` (A^E only), ``turn`` (A^S only) or ``both`` (A^E + weight * A^S).
    """
    if mode not in MODES:
        raise ValueError(f"algo.credit.mode must be one of {MODES}, got {mode!r}")
    m = mask.bool()
    dev = m.device
    task_rewards = task_rewards.to(dev, torch.float32)
    step_rewards = step_rewards.to(dev, torch.float32)
    turns, episode_of = turns.to(dev), episode_of.to(dev)
    episode_group, turn_ids = episode_group.to(dev), turn_ids.to(dev)
    e, k = step_rewards.shape
    finite = torch.isfinite(task_rewards) & torch.isfinite(step_rewards).all(1)
    metrics: dict[str, float] = {}
    table = torch.zeros(e, max(k, 1), device=dev)  # A_{e,t}
    kept = finite.nonzero().squeeze(1)
    if mode in ("episode", "both"):
        a_ep, met = episode_advantages(
            estimator, task_rewards[kept], episode_group[kept], **options
        )
        table[kept] += a_ep[:, None]
        metrics.update({f"episode/{k_}": v for k_, v in met.items()})
    if mode in ("turn", "both"):
        g = returns_to_go(step_rewards, turns, gamma)
        valid = (torch.arange(k, device=dev)[None] < turns[:, None]) & finite[:, None]
        ep, t = valid.nonzero(as_tuple=True)
        if ep.numel():
            a_turn, met = episode_advantages(estimator, g[ep, t], episode_group[ep], **options)
            table[ep, t] += (weight if mode == "both" else 1.0) * a_turn
            metrics.update({f"turn/{k_}": v for k_, v in met.items()})
    tid = turn_ids.clamp(0, max(k, 1) - 1)
    adv = table[episode_of[:, None].expand_as(tid), tid]
    ok = m & finite[episode_of][:, None] & (turn_ids >= 0)
    adv = torch.where(ok, adv, torch.zeros_like(adv))
    metrics["excluded_tokens"] = float((m & ~ok).sum().item())
    n = ok.sum().clamp(min=1)
    mean = adv[ok].sum() / n
    metrics.update(
        {
            "adv_mean": float(mean),
            "adv_std": float(((adv[ok] - mean) ** 2).sum().div(n).sqrt()),
            "episodes": float(e),
        }
    )
    return AdvantageResult(adv.detach(), None, metrics, ok)


def turn_token_rewards(
    step_rewards: Tensor,
    episode_of: Tensor,
    turn_ids: Tensor,
    mask: Tensor,
    *,
    weight: float = 1.0,
) -> Tensor:
    """[B, T] token rewards with ``weight * r_{e,t}`` on the last token of each turn t of the
    sample's episode e (0 elsewhere), for token-level estimators (which read them where `mask`
    is 1)."""
    m = mask.bool()
    out = torch.zeros(m.shape, device=m.device)
    turn_ids = turn_ids.to(m.device)
    # a turn's tokens are one run of equal ids (-1 between turns): its last token is where the
    # next position holds another id
    after = torch.cat([turn_ids[:, 1:], torch.full_like(turn_ids[:, :1], -1)], dim=1)
    last = (turn_ids >= 0) & (after != turn_ids)
    rows, cols = last.nonzero(as_tuple=True)
    if rows.numel():
        ep = episode_of.to(m.device)[rows]
        t = turn_ids[rows, cols]
        out[rows, cols] = weight * step_rewards.to(m.device, torch.float32)[ep, t]
    return out
