"""Bad input: a ValueError naming the argument, or the documented handling."""

from __future__ import annotations

import pytest
import torch

from weir.algo import (
    aggregate_loss,
    compute_advantages,
    compute_policy_loss,
    entropy_from_logits,
    kl_penalty,
    rollout_correction,
)

NAN = float("nan")
R = torch.tensor([1.0, 0.0])
M = torch.ones(2, 3)
G = torch.tensor([0, 0])


def adv(*args, **kw):
    return compute_advantages(*args, **kw)


# ------------------------------------------------------------------ compute_advantages


@pytest.mark.parametrize(
    "args, kw, match",
    [
        (("grpo", torch.tensor([1.0, 0.0, 1.0]), M, G), {}, r"rewards: expected shape \(2,\)"),
        (("grpo", torch.ones(2, 1), M, G), {}, "rewards: expected 1 dimension"),
        (("grpo", torch.tensor([1, 0]), M, G), {}, "rewards: expected a floating-point"),
        (("grpo", [1.0, 0.0], M, G), {}, "rewards: expected a torch.Tensor"),
        (("grpo", R, torch.ones(2, 3, 1), G), {}, "mask: expected a 2-D"),
        (("grpo", R, torch.ones(3, 3), G), {}, r"rewards: expected shape \(3,\)"),
        (("grpo", R, M, torch.tensor([0, 0, 1])), {}, r"group_ids: expected shape \(2,\)"),
        (("grpo", R, M, torch.tensor([0.0, 0.0])), {}, "group_ids: expected an integer"),
        (("grpo", R, M * 2, G), {}, "mask: expected only 0 and 1"),
        (("grpo", torch.ones(0), torch.ones(0, 3), torch.ones(0).long()), {}, "empty"),
        (("grpo", R, torch.ones(2, 0), G), {}, "mask: empty batch"),
        (("grpo", R, torch.zeros(2, 3), G), {}, "mask: selects no token"),
        (("gae", R, M, G), {}, "values"),
        (("gae", R, M, G), {"values": torch.ones(2, 2)}, r"values: expected shape \(2, 3\)"),
        (
            ("gae", R, M, G),
            {"values": torch.tensor([[0.0, NAN, 0.0], [0.0, 0.0, 0.0]])},
            "values: expected finite",
        ),
        (
            ("grpo", R, M, G),
            {"token_rewards": torch.full((2, 3), float("inf"))},
            "token_rewards: expected finite",
        ),
        (("grpo", R, M, G), {"values": torch.ones(2, 3)}, "does not take the option 'values'"),
        (("grpo", R, M, G), {"norm_by_sdt": False}, "did you mean 'norm_by_std'"),
        (("reinforce_pp", R, M, G), {"gamma": 1.5}, r"gamma: expected a number in \[0, 1\]"),
        (("gae", R, M, G), {"values": torch.ones(2, 3), "lam": -0.1}, "lam"),
        (("grpo", R, M, G), {"eps": 0.0}, "eps"),
        (("grop", R, M, G), {}, "did you mean 'grpo'"),
    ],
)
def test_advantages_value_errors(args, kw, match):
    with pytest.raises(ValueError, match=match):
        adv(*args, **kw)


def test_all_rewards_nan_raises():
    with pytest.raises(ValueError, match="rewards: 2 of 2 rewards are NaN/inf"):
        adv("grpo", torch.tensor([NAN, NAN]), M, G)


def test_nan_reward_leaves_nothing_trainable_raises():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="no trained token"):
        adv("grpo", torch.tensor([NAN, 1.0]), mask, G)


def test_nan_reward_is_counted_not_propagated():
    res = adv("grpo", torch.tensor([1.0, NAN, 0.0]), torch.ones(3, 2), torch.zeros(3).long())
    assert res.metrics["nonfinite_rewards"] == 1.0
    assert torch.isfinite(res.advantages).all()
    assert all(v == v for v in res.metrics.values())


def test_user_estimator_producing_nan_is_caught():
    def broken(rewards, mask, group_ids):
        return torch.full(mask.shape, NAN)

    with pytest.raises(ValueError, match="broken advantages"):
        adv(broken, R, M, G)


def test_user_estimator_wrong_shape_is_caught():
    def wrong(rewards, mask, group_ids):
        return torch.zeros(2, 5)

    with pytest.raises(ValueError, match=r"wrong advantages: expected shape \(2, 3\)"):
        adv(wrong, R, M, G)


# ------------------------------------------------------------------ compute_policy_loss

LP = torch.zeros(2, 3)
KW = dict(agg="token-mean", num_tokens=6, num_seqs=2)


@pytest.mark.parametrize(
    "name, args, kw, match",
    [
        ("ppo", (LP, torch.zeros(2, 4), LP, M), {}, r"old_logp: expected shape \(2, 3\)"),
        ("ppo", (LP, LP, torch.zeros(3, 3), M), {}, r"advantages: expected shape \(2, 3\)"),
        ("ppo", (LP, LP, LP, torch.ones(3, 3)), {}, r"mask: expected shape \(2, 3\)"),
        ("ppo", (torch.zeros(2, 3, 4), LP, LP, M), {}, "logp: expected 2 dimension"),
        ("ppo", (torch.zeros(0, 3), LP, LP, torch.ones(0, 3)), {}, "empty batch"),
        ("ppo", (LP, None, LP, M), {}, "old_logp"),
        ("ppo", (LP, LP, None, M), {}, "advantages"),
        ("ppo", (LP, LP, LP, M), {"agg": "token_mean"}, "did you mean 'token-mean'"),
        ("ppo", (LP, LP, LP, M), {"agg": "seq-mean-token-sum-norm"}, "max_len"),
        ("ppo", (LP, LP, LP, M), {"num_tokens": 0}, "num_tokens"),
        ("ppo", (LP, LP, LP, M), {"num_seqs": -1}, "num_seqs"),
        ("ppo", (LP, LP, LP, M), {"eps_hihg": 0.28}, "did you mean 'eps_high'"),
        ("ppo", (LP, LP, LP, M), {"dual_clip": 0.5}, "dual_clip: expected a number > 1"),
        ("ppo", (LP, LP, LP, M), {"eps_low": 1.5}, "eps_low"),
        ("ppo", (LP, LP, LP, M), {"behavior_logp": LP}, "does not take the option 'behavior_logp'"),
        ("decoupled_ppo", (LP, LP, LP, M), {}, "behavior_logp"),
        ("decoupled_ppo", (LP, LP, LP, M), {"behavior_logp": LP, "cap_mode": "clip"}, "cap_mode"),
        ("ppo", (LP, LP, LP, M), {"kl_coef": 0.1}, "ref_logp"),
        ("ppo", (LP, LP, LP, M), {"entropy_coef": 0.1}, "entropy"),
        ("ppo", (LP, LP, LP, M), {"weights": torch.ones(2, 2)}, r"weights: expected shape"),
        ("ppo", (LP, LP, torch.full((2, 3), NAN), M), {}, "advantages: expected finite"),
        ("ppo", (torch.full((2, 3), float("inf")), LP, LP, M), {}, "logp: expected finite"),
        (
            "ppo",
            (LP, LP, LP, M),
            {"ref_logp": torch.full((2, 3), NAN)},
            "ref_logp: expected finite",
        ),
        ("pop", (LP, LP, LP, M), {}, "did you mean 'ppo'"),
        ("ppo", (LP, LP, LP, M), {"kl_kind": "k4"}, "kl_kind: unknown KL estimator 'k4'"),
    ],
)
def test_policy_loss_value_errors(name, args, kw, match):
    call_kw = {**KW, **kw}
    with pytest.raises(ValueError, match=match):
        compute_policy_loss(name, *args, **call_kw)


def test_user_loss_producing_nan_is_caught():
    def nan_loss(logp, old_logp, advantages, mask):
        return logp * NAN, {}

    with pytest.raises(ValueError, match="non-finite"):
        compute_policy_loss(nan_loss, LP, LP, LP, M, **KW)


def test_dual_clip_behavior_logp_typo_in_decoupled():
    with pytest.raises(ValueError, match="did you mean 'tis_cap'"):
        compute_policy_loss("decoupled_ppo", LP, LP, LP, M, behavior_logp=LP, tis_cpa=2.0, **KW)


# ------------------------------------------------------------------ other functions


def test_aggregate_loss_errors():
    with pytest.raises(ValueError, match="per_token_loss: expected finite"):
        aggregate_loss(torch.full((2, 3), NAN), M, "token-mean", num_tokens=1, num_seqs=1)
    with pytest.raises(ValueError, match=r"mask: expected shape \(2, 3\)"):
        aggregate_loss(LP, torch.ones(2, 2), "token-mean", num_tokens=1, num_seqs=1)
    with pytest.raises(ValueError, match="max_len: expected a positive int"):
        aggregate_loss(LP, M, "seq-mean-token-sum-norm", num_tokens=1, num_seqs=1, max_len=0)


def test_kl_shape_mismatch():
    with pytest.raises(ValueError, match="ref_logp: expected shape"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 4), "k1")


def test_correction_shape_mismatch():
    with pytest.raises(ValueError, match="rollout_logp: expected shape"):
        rollout_correction(LP, torch.zeros(2, 4), M)
    with pytest.raises(ValueError, match="mask: expected shape"):
        rollout_correction(LP, LP, torch.ones(3, 3))


def test_entropy_errors():
    with pytest.raises(ValueError, match="logits"):
        entropy_from_logits(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="non-finite"):
        entropy_from_logits(torch.tensor([[NAN, 0.0]]))
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(torch.zeros(2, 3), temperature=0.0)
    with pytest.raises(ValueError, match="logits: expected a floating-point"):
        entropy_from_logits(torch.zeros(2, 3, dtype=torch.long))
