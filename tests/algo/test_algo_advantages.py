"""Advantage estimators against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from weir.algo import ADVANTAGES, compute_advantages, masked_whiten

NAN = float("nan")


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, t(b) if not isinstance(b, torch.Tensor) else b, atol=atol, rtol=0)


def test_registry_has_every_estimator():
    assert set(ADVANTAGES) == {"grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"}


# ------------------------------------------------------------------ grpo / dr.grpo


def test_grpo_one_group():
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.5773503; A = ±0.5 / (0.5773503 + 1e-6)
    mask = torch.ones(4, 2)
    res = compute_advantages(
        "grpo", t([1.0, 0.0, 0.0, 1.0]), mask, torch.zeros(4, dtype=torch.long)
    )
    a = 0.8660239
    close(res.advantages, [[a, a], [-a, -a], [-a, -a], [a, a]])
    assert res.returns is None
    assert res.metrics["groups"] == 1.0
    assert res.metrics["zero_std_groups"] == 0.0


def test_grpo_several_groups_singleton_and_mask():
    # group 7: rewards 3, 1 -> mean 2, std sqrt(2); A = ±1/1.4142146 = ±0.7071063
    # group 2: rewards 2, 2, 5 -> mean 3, std sqrt(3); A = -0.5773499, -0.5773499, 1.1546999
    # group 9: a single sample -> 0
    rewards = t([3.0, 2.0, 1.0, 2.0, 5.0, 4.0])
    groups = torch.tensor([7, 2, 7, 2, 2, 9])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    res = compute_advantages("grpo", rewards, mask, groups)
    expected = [
        [0.7071063, 0.7071063, 0.0],
        [-0.5773499, 0.0, 0.0],
        [-0.7071063, -0.7071063, -0.7071063],
        [0.0, -0.5773499, -0.5773499],
        [1.1546999, 1.1546999, 1.1546999],
        [0.0, 0.0, 0.0],
    ]
    close(res.advantages, expected)
    assert res.metrics["groups"] == 3.0
    assert res.metrics["singleton_groups"] == 1.0


def test_dr_grpo_no_std():
    # mean of 3, 1 is 2 -> A = +1, -1; mean of 0.5, 0.5 -> 0 (and a zero-std group)
    res = compute_advantages(
        "grpo",
        t([3.0, 1.0, 0.5, 0.5]),
        torch.ones(4, 1),
        torch.tensor([0, 0, 1, 1]),
        norm_by_std=False,
    )
    close(res.advantages, [[1.0], [-1.0], [0.0], [0.0]])
    assert res.metrics["zero_std_groups"] == 1.0


def test_grpo_all_equal_group_is_exactly_zero():
    # in float32, (0.9 + 0.9 + 0.9) / 3 != 0.9: without care A would be ±0.06, not 0
    for r in (1.0, 0.9, 0.45):
        res = compute_advantages("grpo", t([r, r, r]), torch.ones(3, 2), torch.zeros(3).long())
        assert torch.equal(res.advantages, torch.zeros(3, 2))
        assert res.metrics["zero_std_groups"] == 1.0


def test_grpo_token_rewards_are_summed_into_the_reward():
    # sample rewards 1 and 0; token rewards add -0.5 to sample 0 only on trained tokens
    # (the 9.0 sits on a masked token and is ignored): effective 0.5 and 0 -> Dr.GRPO ±0.25
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    tr = t([[-0.25, -0.25, 9.0], [0.0, 0.0, 0.0]])
    res = compute_advantages(
        "grpo", t([1.0, 0.0]), mask, torch.tensor([0, 0]), token_rewards=tr, norm_by_std=False
    )
    close(res.advantages, [[0.25, 0.25, 0.0], [-0.25, -0.25, -0.25]])


# ------------------------------------------------------------------ rloo


def test_rloo():
    # A1 = 1 - (2+3)/2 = -1.5 ; A2 = 2 - (1+3)/2 = 0 ; A3 = 3 - (1+2)/2 = 1.5 ; singleton -> 0
    res = compute_advantages(
        "rloo", t([1.0, 2.0, 3.0, 10.0]), torch.ones(4, 2), torch.tensor([5, 5, 5, 6])
    )
    close(res.advantages, [[-1.5, -1.5], [0.0, 0.0], [1.5, 1.5], [0.0, 0.0]])


# ------------------------------------------------------------------ reinforce++


def test_reinforce_pp_discounted_and_whitened():
    # one sample, reward 1 on the last token, gamma 0.5 -> G = [0.25, 0.5, 1]
    # mean 0.5833333, unbiased var 0.1458333, std 0.3818813
    res = compute_advantages(
        "reinforce_pp", t([1.0]), torch.ones(1, 3), torch.tensor([0]), gamma=0.5
    )
    close(res.returns, [[0.25, 0.5, 1.0]])
    close(res.advantages, [[-0.8728715, -0.2182179, 1.0910894]])


def test_reinforce_pp_skips_masked_positions_and_resets_per_row():
    # row 0 mask [1,0,1,0]: last trained token is t=2 -> G_2 = 2, G_0 = 0.5 * 2 = 1 (t=1 skipped)
    # row 1 mask [1,1,0,0], reward -1: G_1 = -1, G_0 = -0.5
    res = compute_advantages(
        "reinforce_pp",
        t([2.0, -1.0]),
        t([[1, 0, 1, 0], [1, 1, 0, 0]]),
        torch.tensor([0, 1]),
        gamma=0.5,
        whiten=False,
    )
    close(res.returns, [[1.0, 0.0, 2.0, 0.0], [-0.5, -1.0, 0.0, 0.0]])
    close(res.advantages, res.returns)


def test_reinforce_pp_token_rewards():
    # token rewards [0.1, 0.2, 0.3] plus outcome 1 on the last token, gamma 1:
    # G = [1.6, 1.5, 1.3]
    res = compute_advantages(
        "reinforce_pp",
        t([1.0]),
        torch.ones(1, 3),
        torch.tensor([0]),
        token_rewards=t([[0.1, 0.2, 0.3]]),
        whiten=False,
    )
    close(res.advantages, [[1.6, 1.5, 1.3]])


def test_reinforce_pp_baseline():
    # group 0: rewards 1, 0 -> r' = 0.5, -0.5 ; group 1: single sample -> r' = 0
    # tokens (all masked-in, 2 each): [.5,.5,-.5,-.5,0,0]; mean 0; unbiased var = 1/5 = 0.2
    # whitened: ±0.5/sqrt(0.2) = ±1.118034
    res = compute_advantages(
        "reinforce_pp_baseline", t([1.0, 0.0, 7.0]), torch.ones(3, 2), torch.tensor([0, 0, 1])
    )
    close(res.returns, [[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0]])
    a = 1.118034
    close(res.advantages, [[a, a], [-a, -a], [0.0, 0.0]])


# ------------------------------------------------------------------ gae


def test_gae_skips_tool_output_tokens():
    # mask [1,0,1,1] (t=1 is tool output), V = [0.5, 9, 0.4, 0.8], reward 1 on t=3,
    # gamma 0.9, lam 0.8:
    #   t=3: delta = 1 - 0.8 = 0.2                 A = 0.2
    #   t=2: delta = 0.9*0.8 - 0.4 = 0.32          A = 0.32 + 0.72*0.2   = 0.464
    #   t=0: delta = 0.9*0.4 - 0.5 = -0.14 (next trained token is t=2)
    #                                             A = -0.14 + 0.72*0.464 = 0.19408
    # returns = A + V = [0.69408, 0, 0.864, 1.0]
    res = compute_advantages(
        "gae",
        t([1.0]),
        t([[1, 0, 1, 1]]),
        torch.tensor([0]),
        values=t([[0.5, 9.0, 0.4, 0.8]]),
        gamma=0.9,
        lam=0.8,
        whiten=False,
    )
    close(res.advantages, [[0.19408, 0.0, 0.464, 0.2]])
    close(res.returns, [[0.69408, 0.0, 0.864, 1.0]])


def test_gae_gamma_lam_one_is_return_minus_value_and_whitening():
    # gamma = lam = 1: A_t = R_total - V_t ; two rows
    # row 0: reward 1, V = [0.2, 0.6] -> A = [0.8, 0.4]
    # row 1: reward 0, V = [0.1, 0.0] with t=1 padding -> A = [-0.1]
    values = t([[0.2, 0.6], [0.1, 5.0]])
    mask = t([[1, 1], [1, 0]])
    raw = compute_advantages(
        "gae", t([1.0, 0.0]), mask, torch.tensor([0, 0]), values=values, whiten=False
    )
    close(raw.advantages, [[0.8, 0.4], [-0.1, 0.0]])
    close(raw.returns, [[1.0, 1.0], [0.0, 0.0]])
    # whitening over the 3 trained tokens: mean 0.3666667, unbiased var 0.2033333,
    # std 0.4509250 -> 0.4333333/0.450925, 0.0333333/0.450925, -0.4666667/0.450925
    white = compute_advantages("gae", t([1.0, 0.0]), mask, torch.tensor([0, 0]), values=values)
    close(white.advantages, [[0.9609876, 0.0739221], [-1.0349098, 0.0]])
    close(white.returns, raw.returns)


def test_gae_token_rewards_kl_penalty():
    # token rewards [-0.1, -0.1], outcome 1, V = 0, gamma = lam = 1 -> A = [0.8, 0.9]
    res = compute_advantages(
        "gae",
        t([1.0]),
        torch.ones(1, 2),
        torch.tensor([0]),
        values=torch.zeros(1, 2),
        token_rewards=t([[-0.1, -0.1]]),
        whiten=False,
    )
    close(res.advantages, [[0.8, 0.9]])


# ------------------------------------------------------------------ NaN rewards


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_nan_reward_excludes_the_sample(name):
    kw = {"values": torch.zeros(4, 2)} if name == "gae" else {}
    rewards = t([1.0, NAN, 0.0, float("inf")])
    res = compute_advantages(name, rewards, torch.ones(4, 2), torch.zeros(4).long(), **kw)
    assert res.metrics["nonfinite_rewards"] == 2.0
    assert res.metrics["excluded_tokens"] == 4.0
    assert torch.isfinite(res.advantages).all()
    close(res.advantages[1], [0.0, 0.0])
    close(res.advantages[3], [0.0, 0.0])
    assert res.mask.tolist() == [[True, True], [False, False], [True, True], [False, False]]
    # same numbers as the batch without those samples
    ref = compute_advantages(
        name,
        t([1.0, 0.0]),
        torch.ones(2, 2),
        torch.zeros(2).long(),
        **({"values": torch.zeros(2, 2)} if name == "gae" else {}),
    )
    close(res.advantages[[0, 2]], ref.advantages)
    assert math.isclose(res.metrics["reward_mean"], 0.5)


def test_nan_reward_group_statistics_ignore_it():
    # group rewards 1, NaN, 0 -> statistics over {1, 0}: Dr.GRPO A = ±0.5
    res = compute_advantages(
        "grpo", t([1.0, NAN, 0.0]), torch.ones(3, 1), torch.zeros(3).long(), norm_by_std=False
    )
    close(res.advantages, [[0.5], [0.0], [-0.5]])


# ------------------------------------------------------------------ helpers


def test_masked_whiten_hand():
    # values 1, 2, 3 (4 masked): mean 2, unbiased var 1 -> -1, 0, 1
    x = t([[1.0, 2.0], [3.0, 4.0]])
    m = torch.tensor([[True, True], [True, False]])
    close(masked_whiten(x, m, eps=0.0 + 1e-12), [[-1.0, 0.0], [1.0, 0.0]])


def test_float64_rewards_stay_float64():
    res = compute_advantages(
        "grpo", t([1.0, 0.0], torch.float64), torch.ones(2, 1), torch.tensor([0, 0])
    )
    assert res.advantages.dtype == torch.float64


def test_outputs_are_detached():
    r = t([1.0, 0.0]).requires_grad_()
    res = compute_advantages("grpo", r, torch.ones(2, 1), torch.tensor([0, 0]))
    assert not res.advantages.requires_grad
