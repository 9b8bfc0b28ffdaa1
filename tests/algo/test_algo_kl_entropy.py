"""KL estimators, KL controllers, entropy and token log-probs from logits."""

from __future__ import annotations

import math

import pytest
import torch

from weir.algo import (
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
)
from weir.algo.kl import kl_token_rewards, make_kl_controller


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


# ------------------------------------------------------------------ kl estimators


def test_kl_estimators_hand_values():
    # logp - ref = +1 and -1
    logp = t([-1.0, -2.0])
    ref = t([-2.0, -1.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), t([1.0, -1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), t([0.5, 0.5]))
    # k3 = e^d - d - 1 with d = ref - logp: e^-1 + 1 - 1 = 0.3678794 ; e^1 - 1 - 1 = 0.7182818
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), t([0.3678794, 0.7182818]))


def test_k3_clamps():
    # d = ref - logp = -30 -> clamped to -20 -> e^-20 + 20 - 1 = 19.0 -> output clamped to 10
    # d = +30 -> clamped to 20 -> e^20 - 21 -> clamped to 10
    out = kl_penalty(t([0.0, -30.0]), t([-30.0, 0.0]), "k3")
    torch.testing.assert_close(out, t([10.0, 10.0]))
    # d = 2: e^2 - 3 = 4.3890561, below the output clamp
    assert kl_penalty(t([0.0]), t([2.0]), "k3").item() == pytest.approx(4.3890561, abs=1e-6)


def test_kl_zero_when_equal_and_nonneg():
    x = torch.randn(50)
    for kind in ("k1", "k2", "k3"):
        assert torch.equal(kl_penalty(x, x, kind), torch.zeros(50))
    y = torch.randn(50)
    assert (kl_penalty(x, y, "k2") >= 0).all() and (kl_penalty(x, y, "k3") >= 0).all()


def test_kl_mask_and_token_rewards():
    logp = t([[-1.0, float("nan")]])
    ref = t([[-2.0, 0.0]])
    mask = t([[1, 0]])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1", mask=mask), t([[1.0, 0.0]]))
    tr = kl_token_rewards(logp, ref, mask, coef=0.1)
    torch.testing.assert_close(tr, t([[-0.1, 0.0]]))


def test_kl_unknown_kind_suggests():
    with pytest.raises(ValueError, match="did you mean 'k3'"):
        kl_penalty(t([0.0]), t([0.0]), "k33")


# ------------------------------------------------------------------ controllers


def test_adaptive_kl_controller():
    # Ziegler et al.: e = clip(kl/target - 1, -0.2, 0.2); value *= 1 + e * n / horizon
    c = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    # kl 9 -> e = 0.5 -> clipped 0.2 -> 0.1 * (1 + 0.2 * 256/10000) = 0.100512
    assert c.update(9.0, 256) == pytest.approx(0.100512, abs=1e-12)
    c = AdaptiveKLController(0.1, 6.0, 10000)
    # kl 3 -> e = -0.5 -> -0.2 -> 0.1 * (1 - 0.00512) = 0.099488
    assert c.update(3.0, 256) == pytest.approx(0.099488, abs=1e-12)
    c = AdaptiveKLController(0.1, 6.0, 10000)
    # kl 6.6 -> e = 0.1 (inside the clip) -> 0.1 * (1 + 0.1 * 1000/10000) = 0.101
    assert c.update(6.6, 1000) == pytest.approx(0.101, abs=1e-12)
    state = c.state_dict()
    d = AdaptiveKLController(1.0, 1.0, 1.0)
    d.load_state_dict(state)
    assert d.value == c.value and d.target == 6.0 and d.horizon == 10000
    with pytest.raises(ValueError, match="current_kl"):
        c.update(float("nan"), 1)


def test_fixed_kl_controller():
    c = FixedKLController(0.05)
    assert c.update(100.0, 1000) == 0.05 and c.value == 0.05
    assert isinstance(make_kl_controller("fixed", 0.1), FixedKLController)
    assert isinstance(
        make_kl_controller("adaptive", 0.1, target=6, horizon=100), AdaptiveKLController
    )
    with pytest.raises(ValueError, match="target"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="init_coef"):
        AdaptiveKLController(-1.0, 6.0, 100)


# ------------------------------------------------------------------ entropy


def test_entropy_hand_values():
    # [0, 0] -> ln 2 = 0.6931472 ; [0, ln 3] -> p = (1/4, 3/4) ->
    # -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351 ; one -inf logit -> the other has p = 1 -> 0
    logits = t([[0.0, 0.0], [0.0, math.log(3.0)], [float("-inf"), 1.0]])
    torch.testing.assert_close(entropy_from_logits(logits), t([0.6931472, 0.5623351, 0.0]))


def test_entropy_temperature():
    # logits [0, 2 ln 3] at temperature 2 are [0, ln 3]
    out = entropy_from_logits(t([[0.0, 2 * math.log(3.0)]]), temperature=2.0)
    assert out.item() == pytest.approx(0.5623351, abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 7, 512])
def test_entropy_matches_reference_and_gradient(chunk):
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    out = entropy_from_logits(logits, chunk_size=chunk)
    assert out.shape == (2, 5)
    p = torch.softmax(logits, -1)
    ref = -(p * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(out, ref)
    w = torch.randn(2, 5, dtype=torch.float64)
    (g,) = torch.autograd.grad((out * w).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(g, g_ref)


def test_entropy_gradcheck_with_temperature():
    logits = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 3, temperature=0.7), (logits,))


def test_entropy_bf16_input():
    logits = torch.randn(3, 8).to(torch.bfloat16).requires_grad_()
    out = entropy_from_logits(logits)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


# ------------------------------------------------------------------ log-probs


def test_logprobs_hand_values():
    # logits [0, ln 3]: log p = ln(1/4) = -1.3862944 for id 0, ln(3/4) = -0.2876821 for id 1
    logits = t([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    out = logprobs_from_logits(logits, torch.tensor([0, 1]))
    torch.testing.assert_close(out, t([-1.3862944, -0.2876821]))


@pytest.mark.parametrize("chunk", [1, 2, 5, 512])
def test_logprobs_match_reference_and_gradient(chunk):
    torch.manual_seed(1)
    logits = torch.randn(9, 13, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 13, (9,))
    out = logprobs_from_logits(logits, ids, chunk_size=chunk, temperature=1.3)
    ref = torch.log_softmax(logits / 1.3, -1).gather(1, ids[:, None]).squeeze(1)
    torch.testing.assert_close(out, ref)
    w = torch.randn(9, dtype=torch.float64)
    (g,) = torch.autograd.grad((out * w).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(g, g_ref)


def test_logprobs_gradcheck_and_leading_dims():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, ids, 2), (logits,))
    assert logprobs_from_logits(logits, ids).shape == (2, 3)


def test_logprobs_bad_ids():
    with pytest.raises(ValueError, match="token_ids"):
        logprobs_from_logits(torch.randn(2, 4), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="token_ids"):
        logprobs_from_logits(torch.randn(2, 4), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="token_ids"):
        logprobs_from_logits(torch.randn(2, 4), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="-inf"):
        logprobs_from_logits(t([[float("-inf"), 0.0]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="chunk_size"):
        logprobs_from_logits(torch.randn(2, 4), torch.tensor([0, 1]), chunk_size=0)
