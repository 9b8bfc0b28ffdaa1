"""Rollout: how prompts become scored groups (rollout functions, rewards, filters).

The entry points a loop of your own needs (examples/minimal_grpo.py uses them)::

    ctx = RolloutContext(engine=..., tokenizer=..., sampling=..., reward_fn=get_reward("numeric"),
                         encode=...)
    groups, metrics = collect_groups(ctx, rows, rollout)     # n scored samples per row
    metrics, groups = evaluate(ctx.with_sampling(n=1, temperature=0.0), rows, rollout)
"""

from weir.rollout.collect import collect_groups
from weir.rollout.evaluate import evaluate
from weir.rollout.rewards import get_reward
from weir.rollout.single_turn import RolloutContext, rollout

__all__ = ["RolloutContext", "collect_groups", "evaluate", "get_reward", "rollout"]
