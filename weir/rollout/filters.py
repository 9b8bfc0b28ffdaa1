"""Group filters for `rollout.filter`: `(group) -> bool`, True keeps the group."""

from __future__ import annotations

from weir.data.sample import Group


def nonzero_std(group: Group) -> bool:
    """Keep groups whose rewards are not all equal (DAPO dynamic sampling, Yu et al. 2025).

    A group where every sample got the same reward has zero group-relative advantage and adds
    no gradient, only noise in the token-mean normalisation.
    """
    rewards = [s.reward for s in group.samples if s.reward is not None]
    return len(rewards) > 1 and max(rewards) > min(rewards)
