"""Evaluation: mean reward, accuracy and unbiased pass@k over held-out rows with the engine."""

from __future__ import annotations

import math
from collections.abc import Callable

from weir.rollout.collect import collect_groups
from weir.rollout.roles import episode_rewards, role_of
from weir.rollout.single_turn import RolloutContext


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n - c, k) / C(n, k) for c correct of n samples."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(
    ctx: RolloutContext,
    rows: list[dict],
    fn: Callable,
    *,
    correct_at: float = 1.0,
    breakdown: str | None = None,
) -> tuple[dict[str, float], list]:
    """Roll out `rows` with `ctx`'s (eval) sampling; a sample is correct when reward >= `correct_at`.

    Returns metrics (eval/reward, eval/accuracy, eval/pass@k for k = 1, 2, 4, ... <= n) and the groups.
    `breakdown` names a row field: the accuracy of the rows with each of its values is added as
    ``eval/<field>/<value>/accuracy`` (rows without the field are left out of it).
    """
    groups, gen = collect_groups(ctx, rows, fn)
    n = ctx.sampling.n
    rewards, per_prompt = [], []
    for g in groups:
        rs = episode_rewards(g)  # multi-agent: one (team) reward per episode
        if rs is None:
            first = [s for s in g.samples if s.metadata.get("segment", 0) == 0]  # once an episode
            rs = [s.reward if s.reward is not None else 0.0 for s in first]
        rs += [0.0] * (n - len(rs))  # a failed group holds one sample: the rest count as failures
        rewards.extend(rs)
        per_prompt.append(sum(r >= correct_at for r in rs))
    metrics = {
        "eval/reward": sum(rewards) / max(len(rewards), 1),
        "eval/accuracy": sum(per_prompt) / max(len(per_prompt) * n, 1),
        "eval/prompts": float(len(groups)),
        "eval/failed": gen["rollout/failed"],
        "eval/response_length": gen["response/length_mean"],
        "eval/time": gen["time/generate"],
    }
    metrics.update(_role_accuracy(groups, correct_at))
    if breakdown is not None:
        metrics.update(_breakdown_accuracy(groups, per_prompt, n, breakdown))
    k = 1
    while k <= n:
        metrics[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in per_prompt) / max(
            len(per_prompt), 1
        )
        k *= 2
    return metrics, groups


def _role_accuracy(groups: list, correct_at: float) -> dict[str, float]:
    """Multi-agent: ``eval/<role>/accuracy``, the fraction of a role's samples whose own reward
    (the scorer's, else the credited one) is >= `correct_at`; failed samples count as wrong."""
    hits: dict[str, list[bool]] = {}
    for g in groups:
        for s in g.samples:
            role = role_of(s)
            if role is None:
                continue
            r = s.reward_info.get("role_reward", s.reward)
            hits.setdefault(role, []).append(r is not None and r >= correct_at)
    return {f"eval/{role}/accuracy": sum(h) / len(h) for role, h in hits.items()}


def _breakdown_accuracy(
    groups: list, per_prompt: list[int], n: int, field: str
) -> dict[str, float]:
    """``eval/<field>/<value>/accuracy``: correct samples / (n * prompts) over the prompts whose
    row has ``row[field] == value``."""
    hits: dict[str, list[int]] = {}
    for g, correct in zip(groups, per_prompt, strict=True):
        if field in g.row:
            hits.setdefault(str(g.row[field]), []).append(correct)
    return {f"eval/{field}/{v}/accuracy": sum(c) / (len(c) * n) for v, c in sorted(hits.items())}
