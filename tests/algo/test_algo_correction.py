"""Rollout/trainer mismatch corrections against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from weir.algo import CORRECTION_MODES, rollout_correction


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# train - rollout = +0.5 and -0.8 -> rho = 1.6487213, 0.4493290 ;
# sequence log-ratio -0.3 -> rho_seq = 0.7408182
TRAIN = t([[-1.0, -1.0]])
ROLL = t([[-1.5, -0.2]])
MASK = torch.ones(1, 2)


def approx(x):
    return pytest.approx(x, abs=1e-6)


def test_metrics_hand_values():
    res = rollout_correction(TRAIN, ROLL, MASK)
    m = res.metrics
    assert m["ratio_mean"] == approx((1.6487213 + 0.4493290) / 2)
    assert m["ratio_max"] == approx(1.6487213)
    assert m["seq_ratio_mean"] == approx(0.7408182)
    # k3: (1.6487213 - 1 - 0.5) + (0.4493290 - 1 + 0.8) = 0.1487213 + 0.2493290 -> 0.1990251
    assert m["kl_k3"] == approx(0.1990251)
    assert m["kl_k1"] == approx(0.15)  # mean of rollout - train = (-0.5 + 0.8) / 2
    assert m["abs_logp_diff_mean"] == approx(0.65)
    assert m["abs_logp_diff_max"] == approx(0.8)
    assert m["masked_frac"] == 0.0
    torch.testing.assert_close(res.weights, t([[1.0, 1.0]]))
    assert res.mask.tolist() == [[True, True]]


def test_token_tis():
    res = rollout_correction(TRAIN, ROLL, MASK, mode="token_tis", cap=1.5)
    torch.testing.assert_close(res.weights, t([[1.5, 0.4493290]]))
    assert res.metrics["truncated_frac"] == 0.5


def test_seq_tis():
    res = rollout_correction(TRAIN, ROLL, MASK, mode="seq_tis", cap=1.5)
    torch.testing.assert_close(res.weights, t([[0.7408182, 0.7408182]]))
    # cap below the sequence ratio truncates both tokens
    res = rollout_correction(TRAIN, ROLL, MASK, mode="seq_tis", cap=0.5)
    torch.testing.assert_close(res.weights, t([[0.5, 0.5]]))
    assert res.metrics["truncated_frac"] == 1.0


def test_seq_ratio_geometric():
    # geometric mean: exp(-0.3 / 2) = 0.8607080
    res = rollout_correction(TRAIN, ROLL, MASK, mode="seq_tis", seq_ratio="geometric")
    torch.testing.assert_close(res.weights, t([[0.8607080, 0.8607080]]))


def test_token_mask():
    res = rollout_correction(TRAIN, ROLL, MASK, mode="token_mask", low=0.5, high=2.0)
    assert res.mask.tolist() == [[True, False]]
    torch.testing.assert_close(res.weights, t([[1.0, 0.0]]))
    assert res.metrics["masked_frac"] == 0.5
    assert res.metrics["masked_seq_frac"] == 0.0


def test_seq_mask():
    # two sequences: the first has rho_seq 0.7408182 (rejected with low 0.8), the second 1.0
    train = torch.cat([TRAIN, t([[-1.0, -3.0]])])
    roll = torch.cat([ROLL, t([[-1.0, -3.0]])])
    res = rollout_correction(train, roll, torch.ones(2, 2), mode="seq_mask", low=0.8, high=1.25)
    assert res.mask.tolist() == [[False, False], [True, True]]
    torch.testing.assert_close(res.weights, t([[0.0, 0.0], [1.0, 1.0]]))
    assert res.metrics["masked_frac"] == 0.5
    assert res.metrics["masked_seq_frac"] == 0.5


def test_masked_positions_ignored_and_weights_detached():
    train = t([[-1.0, float("nan")]]).requires_grad_()
    roll = t([[-1.5, float("inf")]])
    for mode in CORRECTION_MODES:
        res = rollout_correction(train, roll, t([[1, 0]]), mode=mode, cap=1.5)
        assert torch.isfinite(res.weights).all()
        assert not res.weights.requires_grad
        assert res.weights[0, 1].item() == 0.0


def test_all_masked_gives_zeros():
    res = rollout_correction(TRAIN, ROLL, torch.zeros(1, 2), mode="token_tis")
    assert torch.equal(res.weights, torch.zeros(1, 2))
    assert all(v == 0.0 for v in res.metrics.values())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "token-tis"}, "did you mean 'token_tis'"),
        ({"cap": 0.0}, "cap"),
        ({"low": 2.0, "high": 1.0}, "low < high"),
        ({"seq_ratio": "mean"}, "seq_ratio"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rollout_correction(TRAIN, ROLL, MASK, **kwargs)


def test_nan_at_trained_position_raises():
    with pytest.raises(ValueError, match="rollout_logp"):
        rollout_correction(TRAIN, t([[float("nan"), 0.0]]), MASK)
