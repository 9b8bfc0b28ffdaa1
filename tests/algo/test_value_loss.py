"""The critic's clipped value loss and GAE, on examples worked out by hand."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.algo import compute_advantages, value_loss


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_clipped_value_loss_by_hand():
    # token 0: V=1.0, V_old=0.5, G=2: unclipped (1-2)^2 = 1; V_clip = 0.5 + 0.3 = 0.8, (0.8-2)^2 = 1.44
    #          -> max is the clipped term (it counts in the clip fraction) and V gets no gradient
    # token 1: V=0.2, V_old=0, G=0: V moved 0.2 < 0.3, both terms 0.04
    # token 2: masked (its huge numbers are never read)
    values = t([1.0, 0.2, 3.0]).requires_grad_(True)
    old, returns, mask = t([0.5, 0.0, 0.0]), t([2.0, 0.0, 9.0]), t([1, 1, 0])
    out = value_loss(values, old, returns, mask, num_tokens=2, clip=0.3)
    assert out.loss.item() == pytest.approx(0.5 * (1.44 + 0.04) / 2)
    assert out.clipfrac_sum == 1.0
    assert out.error_sum == pytest.approx(1.0 + 0.04)
    out.loss.backward()
    # d/dV 0.5 * (V - G)^2 / N on token 1 = (0.2 - 0) / 2 = 0.1; token 0 is clipped: 0
    assert values.grad.tolist()[0] == pytest.approx([0.0, 0.1, 0.0], abs=1e-7)

    plain = value_loss(values, old, returns, mask, num_tokens=2, clip=None, coef=2.0)
    assert plain.loss.item() == pytest.approx(2.0 * 0.5 * (1.0 + 0.04) / 2)
    assert plain.clipfrac_sum == 0.0


def test_clip_that_never_binds_lets_the_gradient_through():
    # V moved down from V_old=2 to 1.5 (by 0.5 > c=0.2) towards G=0: the clipped prediction
    # (1.8) is farther from G, so the clipped term (3.24) is the max and the gradient is 0;
    # moved the other way (2.5, away from G) the unclipped term (6.25) is larger: full gradient
    v = t([1.5, 2.5]).requires_grad_(True)
    out = value_loss(v, t([2.0, 2.0]), t([0.0, 0.0]), t([1, 1]), num_tokens=2, clip=0.2)
    assert out.loss.item() == pytest.approx(0.5 * (1.8**2 + 2.5**2) / 2)
    out.loss.backward()
    assert v.grad.tolist()[0] == pytest.approx([0.0, 2.5 / 2])


def test_gae_by_hand_with_a_skipped_tool_token():
    # gamma 0.9, lam 0.5, reward 1 on the last trained token (3); token 2 is tool output (mask 0):
    # delta_3 = 1 - 0.4 = 0.6;  delta_1 = 0.9 * V_3 - V_1 = 0.36 - 0.2 = 0.16
    # delta_0 = 0.9 * V_1 - V_0 = 0.18 - 0.5 = -0.32
    # A_3 = 0.6; A_1 = 0.16 + 0.45 * 0.6 = 0.43; A_0 = -0.32 + 0.45 * 0.43 = -0.1265
    values = t([0.5, 0.2, 7.0, 0.4])
    out = compute_advantages(
        "gae",
        torch.tensor([1.0]),
        t([1, 1, 0, 1]),
        torch.tensor([0]),
        values=values,
        gamma=0.9,
        lam=0.5,
        whiten=False,
    )
    assert out.advantages.tolist()[0] == pytest.approx([-0.1265, 0.43, 0.0, 0.6])
    assert out.returns.tolist()[0] == pytest.approx([0.3735, 0.63, 0.0, 1.0])


finite = st.floats(-5, 5, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    v=st.lists(finite, min_size=6, max_size=6),
    old=st.lists(finite, min_size=6, max_size=6),
    g=st.lists(finite, min_size=6, max_size=6),
    clip=st.floats(0.01, 2.0),
)
def test_clipping_only_raises_the_loss_and_splits_sum_up(v, old, g, clip):
    values, old_v, ret = (torch.tensor(x).view(3, 2) for x in (v, old, g))
    mask = torch.ones(3, 2)
    clipped = value_loss(values, old_v, ret, mask, num_tokens=6, clip=clip).loss
    plain = value_loss(values, old_v, ret, mask, num_tokens=6, clip=None).loss
    assert clipped.item() >= plain.item() - 1e-6
    huge = value_loss(values, old_v, ret, mask, num_tokens=6, clip=1e6).loss
    assert huge.item() == pytest.approx(plain.item(), rel=1e-6, abs=1e-6)
    # rows split into micro-batches with the mini-batch's token count: the losses add up
    parts = sum(
        value_loss(
            values[i : i + 1], old_v[i : i + 1], ret[i : i + 1], mask[:1], num_tokens=6, clip=clip
        ).loss
        for i in range(3)
    )
    assert parts.item() == pytest.approx(clipped.item(), rel=1e-5, abs=1e-6)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="returns"):
        value_loss(t([1.0]), t([1.0]), t([1.0, 2.0]), t([1]), num_tokens=1)
    with pytest.raises(ValueError, match="clip"):
        value_loss(t([1.0]), t([1.0]), t([1.0]), t([1]), num_tokens=1, clip=-1.0)
    with pytest.raises(ValueError, match="values"):
        value_loss(t(float("nan")), t([1.0]), t([1.0]), t([1]), num_tokens=1)
