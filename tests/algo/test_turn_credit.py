"""Rewards at two levels (weir.algo.turn_credit, weir.train.credit): the expected advantages are worked
out by hand below for one group of two episodes.

    episode 0: task reward 1, two turns with step rewards 1, 0      (response: 2 tokens, 3-token
               observation, 1 token)
    episode 1: task reward 0, one turn with step reward 0           (response: 1 token)
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.algo.turn_credit import returns_to_go, turn_credit_advantages
from weir.config.sections import CreditConfig
from weir.data.sample import Sample
from weir.train.credit import credit_inputs, step_advantages

W = 0.5
EPS = 1e-5


def episode0() -> Sample:
    s = Sample([1, 2], [5, 6, 7, 8, 9, 10], loss_mask=[1, 1, 0, 0, 0, 1], reward=1.5)
    s.reward_info = {"task_reward": 1.0, "env_rewards": [1.0, 0.0], "turns": 2}
    s.metadata = {
        "episode": 0,
        "turns": [
            {"role": "assistant", "tokens": 2},
            {"role": "observation", "tokens": 3},
            {"role": "assistant", "tokens": 1},
        ],
    }
    return s


def episode1() -> Sample:
    s = Sample([1, 2], [11], loss_mask=[1], reward=0.0)
    s.reward_info = {"task_reward": 0.0, "env_rewards": [0.0], "turns": 1}
    s.metadata = {"episode": 1, "turns": [{"role": "assistant", "tokens": 1}]}
    return s


def segments_of_episode0() -> list[Sample]:
    """Episode 0 split after its first turn (image memory rewrote the context)."""
    a, b = episode0(), episode0()
    a.response_ids, a.loss_mask = [5, 6], [1, 1]
    a.rollout_logprobs, a.versions = [0.0] * 2, [-1] * 2
    a.metadata.update(turns=a.metadata["turns"][:1], segment=0, segments=2, turn_offset=0)
    b.prompt_ids, b.response_ids, b.loss_mask = [1, 2, 5, 6, 7, 8, 9], [10], [1]
    b.rollout_logprobs, b.versions = [0.0], [-1]
    b.metadata.update(turns=b.metadata["turns"][2:], segment=1, segments=2, turn_offset=1)
    return [a, b]


def advantages(samples, estimator, mode, **options):
    width = max(len(s.response_ids) for s in samples)
    mask = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        mask[i, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    credit = CreditConfig(mode=mode, step_weight=W)
    rewards = torch.tensor([s.reward for s in samples])
    groups = torch.zeros(len(samples), dtype=torch.long)
    values = torch.zeros(len(samples), width) if estimator == "gae" else None
    return step_advantages(
        credit, estimator, samples, rewards, mask, groups, values=values, options=options
    )


# GRPO by hand: episode term over R = [1, 0]: mean 0.5, unbiased std sqrt(0.5) -> +-1/sqrt(2).
# Turn term over the returns to go G = [1 (e0 t0), 0 (e0 t1), 0 (e1 t0)]: mean 1/3, unbiased std
# sqrt(1/3) -> [2/sqrt(3), -1/sqrt(3), -1/sqrt(3)].
S2, S3 = math.sqrt(2.0), math.sqrt(3.0)
GRPO_BOTH = {(0, 0): 1 / S2 + W * 2 / S3, (0, 1): 1 / S2 - W / S3, (1, 0): -1 / S2 - W / S3}
# RLOO by hand: episode term R_i - mean of the others: [1, -1]; turn term G_i - mean of the group's
# other turns: [1 - 0, 0 - 1/2, 0 - 1/2].
RLOO_BOTH = {(0, 0): 1 + W * 1, (0, 1): 1 - W * 0.5, (1, 0): -1 - W * 0.5}


def token_table(samples, adv) -> dict[tuple[int, int], set[float]]:
    """(episode, turn) -> the advantages its trained tokens got."""
    out: dict[tuple[int, int], set[float]] = {}
    x = credit_inputs(samples, torch.zeros(len(samples), dtype=torch.long), adv.shape[1])
    for b, s in enumerate(samples):
        for j, m in enumerate(s.loss_mask):
            if m:
                key = (s.metadata["episode"], int(x.turn_ids[b, j]))
                out.setdefault(key, set()).add(round(float(adv[b, j]), 5))
    return out


@pytest.mark.parametrize(("estimator", "expected"), [("grpo", GRPO_BOTH), ("rloo", RLOO_BOTH)])
@pytest.mark.parametrize("split", [False, True])
def test_both_adds_the_episode_and_turn_terms(estimator, expected, split):
    samples = (segments_of_episode0() if split else [episode0()]) + [episode1()]
    res = advantages(samples, estimator, "both")
    table = token_table(samples, res.advantages)
    assert set(table) == set(expected)
    for key, want in expected.items():
        (got,) = table[key]  # every token of a turn gets the same advantage
        assert got == pytest.approx(want, abs=EPS), key
    if not split:  # untrained (observation) tokens get nothing
        assert float(res.advantages[0, 2:5].abs().sum()) == 0.0


def test_turn_mode_is_grpo_on_the_step_returns_and_episode_mode_counts_episodes_once():
    samples = [episode0(), episode1()]
    turn = token_table(samples, advantages(samples, "grpo", "turn").advantages)
    assert turn[(0, 0)] == {round(2 / S3, 5)} and turn[(1, 0)] == {round(-1 / S3, 5)}
    # mode=episode with segments: the statistics run over episodes (rewards 1.5 and 0), so the
    # split episode's tokens get +1/sqrt(2), not what a per-sample GRPO over [1.5, 1.5, 0] gives
    split = segments_of_episode0() + [episode1()]
    ep = token_table(split, advantages(split, "grpo", "episode").advantages)
    assert ep[(0, 0)] == ep[(0, 1)] == {round(1 / S2, 5)}


def test_gae_gets_step_rewards_on_turn_ends_and_the_task_reward_at_the_end():
    """Values 0, gamma = lam = 1, no whitening: A_t is the sum of the rewards from t on. Episode 0:
    W * 1 on turn 0's last token, W * 0 on turn 1's, and the task reward 1 on the last token."""
    for split in (False, True):
        samples = (segments_of_episode0() if split else [episode0()]) + [episode1()]
        res = advantages(samples, "gae", "both", whiten=False)
        table = token_table(samples, res.advantages)
        assert table[(0, 0)] == {1.5} and table[(0, 1)] == {1.0} and table[(1, 0)] == {0.0}


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-2, 2, allow_nan=False, width=32), min_size=1, max_size=5),
    st.floats(0.0, 1.0),
)
def test_returns_to_go_match_the_definition(rewards, gamma):
    r = torch.tensor([rewards])
    got = returns_to_go(r, torch.tensor([len(rewards)]), gamma)[0]
    for t in range(len(rewards)):
        want = sum(gamma ** (k - t) * rewards[k] for k in range(t, len(rewards)))
        assert float(got[t]) == pytest.approx(want, abs=1e-4)


def test_a_nonfinite_task_reward_excludes_its_episode():
    res = turn_credit_advantages(
        "grpo",
        torch.tensor([float("nan"), 1.0, 0.0]),
        torch.zeros(3, 1),
        torch.tensor([1, 1, 1]),
        torch.tensor([0, 1, 2]),
        torch.tensor([0, 0, 0]),
        torch.zeros(3, 2, dtype=torch.long),
        torch.ones(3, 2),
        mode="episode",
    )
    assert not res.mask[0].any() and res.mask[1:].all()
    assert res.advantages[1, 0] == pytest.approx(1 / S2, abs=EPS)


def test_credit_config_is_checked_at_start():
    from weir.config import load_config

    with pytest.raises(ValueError, match="multi-turn episodes"):
        load_config(None, ["algo.credit.mode=both"])
    with pytest.raises(ValueError, match="is not one of them"):
        load_config(
            None,
            [
                "algo.credit.mode=turn",
                "rollout.function=weir.rollout.multi_turn:rollout",
                "algo.advantage=my.mod:adv",
            ],
        )
