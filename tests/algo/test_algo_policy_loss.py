"""Policy losses: hand-computed values, metrics and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from weir.algo import POLICY_LOSSES, compute_policy_loss, entropy_from_logits


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def approx(x, rel=0, abs=1e-6):
    return pytest.approx(x, rel=rel, abs=abs)


def ones(shape):
    return torch.ones(shape)


def test_registry_has_every_loss():
    assert set(POLICY_LOSSES) == {"ppo", "gspo", "cispo", "reinforce", "decoupled_ppo"}


# ------------------------------------------------------------------ ppo


def ppo_case():
    # four tokens, log-ratios 0.1, 0.5, -0.5, 1.5 ; A = 1, 1, -1, -1
    old = t([[-1.0, -1.0, -1.0, -1.0]])
    logp = (old + t([[0.1, 0.5, -0.5, 1.5]])).requires_grad_()
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    return logp, old, adv


def test_ppo_hand_values_with_dual_clip():
    # token 1: rho = e^0.1 = 1.1051709 inside        -> -1.1051709
    # token 2: rho = e^0.5 = 1.6487213 > 1.2, A > 0   -> clipped -1.2
    # token 3: rho = e^-0.5 = 0.6065307 < 0.8, A < 0  -> max(0.6065307, 0.8) = 0.8
    # token 4: rho = e^1.5 = 4.4816891, A < 0         -> max(4.4816891, 1.2) = 4.4816891,
    #          dual clip c = 3 caps it at 3
    # token-mean over 4: (-1.1051709 - 1.2 + 0.8 + 3) / 4 = 0.3737073
    logp, old, adv = ppo_case()
    loss, m = compute_policy_loss(
        "ppo",
        logp,
        old,
        adv,
        ones((1, 4)),
        agg="token-mean",
        num_tokens=4,
        num_seqs=1,
        dual_clip=3.0,
    )
    assert loss.item() == approx(0.3737073)
    assert m["clipfrac_high"] == approx(0.25)
    assert m["clipfrac_low"] == approx(0.25)
    assert m["clipfrac_dual"] == approx(0.25)
    assert m["ratio_max"] == approx(4.4816891, abs=1e-5)
    assert m["ratio_mean"] == approx((1.1051709 + 1.6487213 + 0.6065307 + 4.4816891) / 4, abs=1e-5)
    # k3 of KL(old || new): mean of rho - 1 - log rho = (0.0051709 + 0.1487213 + 0.1065307
    # + 1.9816891) / 4 = 0.5605280
    assert m["approx_kl"] == approx(0.5605280)
    assert m["tokens"] == 4.0
    assert m["pg_loss"] == m["loss"] == approx(0.3737073)
    # gradient: only token 1 is unclipped: d/dlogp = -A * rho / N = -1.1051709 / 4
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-1.1051709 / 4, 0.0, 0.0, 0.0]]), atol=1e-6, rtol=0)


def test_ppo_without_dual_clip_keeps_the_large_negative_loss():
    logp, old, adv = ppo_case()
    loss, m = compute_policy_loss(
        "ppo", logp, old, adv, ones((1, 4)), agg="token-mean", num_tokens=4, num_seqs=1
    )
    # (-1.1051709 - 1.2 + 0.8 + 4.4816891) / 4 = 2.9765182 / 4 = 0.7441296
    assert loss.item() == approx(0.7441296)
    assert "clipfrac_dual" not in m
    loss.backward()
    # token 4 (A < 0, ratio above 1 + eps: the unclipped side) keeps gradient -A*rho/N
    assert logp.grad[0, 3].item() == approx(4.4816891 / 4, abs=1e-5)


def test_ppo_clip_higher():
    # rho = e^0.24 = 1.2712492, A = 1: clipped with eps_high 0.2, not with DAPO's 0.28
    old = t([[0.0]])
    logp = t([[0.24]]).requires_grad_()
    kw = dict(agg="token-mean", num_tokens=1, num_seqs=1)
    loss, m = compute_policy_loss("ppo", logp, old, t([[1.0]]), ones((1, 1)), **kw)
    assert loss.item() == approx(-1.2)
    assert m["clipfrac_high"] == 1.0
    loss2, m2 = compute_policy_loss("ppo", logp, old, t([[1.0]]), ones((1, 1)), eps_high=0.28, **kw)
    assert loss2.item() == approx(-1.2712492)
    assert m2["clipfrac_high"] == 0.0


@pytest.mark.parametrize("adv", [2.0, -3.0, 0.5])
def test_ppo_gradient_inside_clip_range_is_minus_a_over_n(adv):
    # on-policy (ratio 1, inside the range): d loss / d theta = -A * d logp/d theta / N
    torch.manual_seed(0)
    theta = torch.randn(3, requires_grad=True)
    feats = torch.randn(2, 5, 3)
    logp = torch.log_softmax(feats @ theta, dim=-1)
    old = logp.detach()
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    N = 8
    loss, _ = compute_policy_loss(
        "ppo",
        logp,
        old,
        torch.full((2, 5), adv),
        mask,
        agg="token-mean",
        num_tokens=N,
        num_seqs=2,
    )
    (g,) = torch.autograd.grad(loss, theta)
    logp2 = torch.log_softmax(feats @ theta, dim=-1)
    (glogp,) = torch.autograd.grad((logp2 * mask).sum(), theta)
    torch.testing.assert_close(g, -adv * glogp / N, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "log_ratio, adv",
    [(0.5, 1.0), (-0.5, -1.0)],  # above 1 + eps with A > 0 ; below 1 - eps with A < 0
)
def test_ppo_gradient_outside_clip_range_is_zero(log_ratio, adv):
    theta = torch.tensor([0.3], requires_grad=True)
    logp = theta * torch.ones(1, 3)
    old = logp.detach() - log_ratio
    loss, _ = compute_policy_loss(
        "ppo",
        logp,
        old,
        torch.full((1, 3), adv),
        ones((1, 3)),
        agg="token-mean",
        num_tokens=3,
        num_seqs=1,
    )
    (g,) = torch.autograd.grad(loss, theta)
    assert g.item() == 0.0


def test_ppo_log_ratio_is_clamped():
    # log-ratio 50 would overflow exp in float32 arithmetic chains; it is clamped to 20
    old = t([[-60.0]])
    logp = t([[-10.0]])
    _, m = compute_policy_loss(
        "ppo", logp, old, t([[-1.0]]), ones((1, 1)), agg="token-mean", num_tokens=1, num_seqs=1
    )
    assert m["ratio_max"] == approx(math.exp(20.0), rel=1e-5)


# ------------------------------------------------------------------ gspo


def test_gspo_hand_values_and_gradient():
    # seq 1: log-ratios 0.1, 0.3 -> s = e^0.2 = 1.2214028, A = 1, inside (eps 0.3)
    # seq 2: one token (second is padding), log-ratio -0.5 -> s = 0.6065307, A = -1:
    #        max(0.6065307, 0.7) = 0.7 (clipped)
    # seq-mean-token-mean: (-1.2214028 + 0.7) / 2 = -0.2607014
    old = t([[-1.0, -2.0], [-1.0, -1.0]])
    logp = (old + t([[0.1, 0.3], [-0.5, 0.0]])).requires_grad_()
    adv = t([[1.0, 1.0], [-1.0, -1.0]])
    mask = t([[1, 1], [1, 0]])
    loss, m = compute_policy_loss(
        "gspo",
        logp,
        old,
        adv,
        mask,
        agg="seq-mean-token-mean",
        num_tokens=3,
        num_seqs=2,
        eps_low=0.3,
        eps_high=0.3,
    )
    assert loss.item() == approx(-0.2607014)
    assert m["ratio_max"] == approx(1.2214028)
    assert m["ratio_mean"] == approx((1.2214028 + 0.6065307) / 2)
    assert m["clipfrac_low"] == approx(1 / 3)
    loss.backward()
    # d/dlogp_t of -s*A (seq 1) = -s/|y| per token, / num_seqs: -1.2214028 / 2 / 2
    torch.testing.assert_close(
        logp.grad, t([[-0.3053507, -0.3053507], [0.0, 0.0]]), atol=1e-6, rtol=0
    )


def test_gspo_default_bounds_are_tight():
    old = t([[0.0, 0.0]])
    logp = t([[0.01, 0.01]])
    _, m = compute_policy_loss(
        "gspo",
        logp,
        old,
        t([[1.0, 1.0]]),
        ones((1, 2)),
        agg="seq-mean-token-mean",
        num_tokens=2,
        num_seqs=1,
    )
    assert m["clipfrac_high"] == 1.0  # e^0.01 = 1.01005 > 1 + 4e-4


# ------------------------------------------------------------------ cispo


def test_cispo_hand_values_and_gradient():
    # token 1: rho = e^0.5 = 1.6487 -> w = 1.2 ; A = 2 ; logp = -1 -> l = -1.2*2*(-1) = 2.4
    # token 2: rho = e^-0.1 = 0.9048374 (no lower bound) ; A = -1 ; logp = -2
    #          -> l = -0.9048374 * (-1) * (-2) = -1.8096748
    # mean: (2.4 - 1.8096748) / 2 = 0.2951626
    logp = t([[-1.0, -2.0]]).requires_grad_()
    old = t([[-1.5, -1.9]])
    adv = t([[2.0, -1.0]])
    loss, m = compute_policy_loss(
        "cispo", logp, old, adv, ones((1, 2)), agg="token-mean", num_tokens=2, num_seqs=1
    )
    assert loss.item() == approx(0.2951626)
    assert m["clipfrac_high"] == 0.5
    assert m["clipfrac_low"] == 0.0
    loss.backward()
    # gradient -w*A/N, also for the truncated token
    torch.testing.assert_close(logp.grad, t([[-2.4 / 2, 0.9048374 / 2]]), atol=1e-6, rtol=0)


def test_cispo_lower_bound():
    # rho = e^-0.5 = 0.6065307 clipped up to 0.8 with eps_low 0.2 ; A = 1, logp = -1 -> 0.8
    loss, m = compute_policy_loss(
        "cispo",
        t([[-1.0]]),
        t([[-0.5]]),
        t([[1.0]]),
        ones((1, 1)),
        agg="token-mean",
        num_tokens=1,
        num_seqs=1,
        eps_low=0.2,
    )
    assert loss.item() == approx(0.8)
    assert m["clipfrac_low"] == 1.0


# ------------------------------------------------------------------ reinforce


def test_reinforce():
    # -A*logp: -(2 * -1) = 2 ; -(-1 * -3) = -3 ; seq-mean-token-sum, 1 seq: (2 - 3) / 1 = -1
    logp = t([[-1.0, -3.0]]).requires_grad_()
    loss, m = compute_policy_loss(
        "reinforce",
        logp,
        None,
        t([[2.0, -1.0]]),
        ones((1, 2)),
        agg="seq-mean-token-sum",
        num_tokens=2,
        num_seqs=1,
    )
    assert loss.item() == approx(-1.0)
    assert "ratio_mean" not in m
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-2.0, 1.0]]))


# ------------------------------------------------------------------ decoupled ppo


def test_decoupled_ppo_hand_values():
    # token 1: rho = e^(-1 - -1.1) = e^0.1 inside ; w = e^(-1.1 - -1.5) = e^0.4 = 1.4918247
    #          l = -1.4918247 * 1.1051709 = -1.6487213
    # token 2: rho = 1 ; w = e^(-1 - -2) = e^1 = 2.7182818 -> capped at 2 ; l = -2
    # mean = -1.8243606
    logp = t([[-1.0, -1.0]])
    prox = t([[-1.1, -1.0]])
    behav = t([[-1.5, -2.0]])
    adv = t([[1.0, 1.0]])
    loss, m = compute_policy_loss(
        "decoupled_ppo",
        logp,
        prox,
        adv,
        ones((1, 2)),
        agg="token-mean",
        num_tokens=2,
        num_seqs=1,
        behavior_logp=behav,
    )
    assert loss.item() == approx(-1.8243606)
    assert m["behav_capped_frac"] == 0.5
    assert m["behav_weight_max"] == approx(2.7182818, abs=1e-5)
    # mask mode drops token 2: (-1.6487213 + 0) / 2
    loss2, _ = compute_policy_loss(
        "decoupled_ppo",
        logp,
        prox,
        adv,
        ones((1, 2)),
        agg="token-mean",
        num_tokens=2,
        num_seqs=1,
        behavior_logp=behav,
        cap_mode="mask",
    )
    assert loss2.item() == approx(-0.8243606)


def test_decoupled_ppo_equals_ppo_when_behavior_is_proximal():
    torch.manual_seed(1)
    logp = torch.randn(3, 4, requires_grad=True)
    old = logp.detach() + 0.3 * torch.randn(3, 4)
    adv = torch.randn(3, 4)
    kw = dict(agg="token-mean", num_tokens=12, num_seqs=3)
    a, _ = compute_policy_loss("ppo", logp, old, adv, ones((3, 4)), **kw)
    b, _ = compute_policy_loss(
        "decoupled_ppo", logp, old, adv, ones((3, 4)), behavior_logp=old, **kw
    )
    assert a.item() == approx(b.item())


# ------------------------------------------------------------------ weights, kl, entropy


def test_weights_multiply_the_per_token_loss():
    # reinforce: l = -A*logp = [1, 2] ; weights [0.5, 2] -> (0.5 + 4) / 2 = 2.25
    loss, _ = compute_policy_loss(
        "reinforce",
        t([[-1.0, -2.0]]),
        None,
        t([[1.0, 1.0]]),
        ones((1, 2)),
        agg="token-mean",
        num_tokens=2,
        num_seqs=1,
        weights=t([[0.5, 2.0]]),
    )
    assert loss.item() == approx(2.25)


def test_kl_loss_term():
    # reinforce with A = 0 (pg loss 0) ; k1 with logp - ref = [1, -1] -> mean 0 ;
    # k2 -> 0.5 each -> 0.5 ; coefficient 0.1 -> loss 0.05
    logp = t([[-1.0, -2.0]])
    ref = t([[-2.0, -1.0]])
    kw = dict(agg="token-mean", num_tokens=2, num_seqs=1, ref_logp=ref, kl_coef=0.1)
    loss, m = compute_policy_loss(
        "reinforce", logp, None, torch.zeros(1, 2), ones((1, 2)), kl_kind="k2", **kw
    )
    assert loss.item() == approx(0.05)
    assert m["kl_ref"] == approx(0.5)
    # k3: (e^-1 + 1 - 1) = 0.3678794 and (e^1 - 1 - 1) = 0.7182818 -> mean 0.5430806
    loss, m = compute_policy_loss("reinforce", logp, None, torch.zeros(1, 2), ones((1, 2)), **kw)
    assert m["kl_ref"] == approx(0.5430806)
    assert loss.item() == approx(0.05430806)


def test_entropy_bonus():
    logits = torch.zeros(1, 2, 2, requires_grad=True)
    ent = entropy_from_logits(logits)  # ln 2 each
    loss, m = compute_policy_loss(
        "reinforce",
        t([[-1.0, -1.0]]),
        None,
        torch.zeros(1, 2),
        ones((1, 2)),
        agg="token-mean",
        num_tokens=2,
        num_seqs=1,
        entropy=ent,
        entropy_coef=0.01,
    )
    assert m["entropy"] == approx(0.6931472)
    assert loss.item() == approx(-0.006931472)
    loss.backward()
    assert logits.grad is not None


def test_all_masked_micro_batch_gives_zero_loss_and_zero_grad():
    logp = torch.randn(2, 3, requires_grad=True)
    for name in POLICY_LOSSES:
        kw = {"behavior_logp": torch.randn(2, 3)} if name == "decoupled_ppo" else {}
        loss, m = compute_policy_loss(
            name,
            logp,
            torch.randn(2, 3),
            torch.randn(2, 3),
            torch.zeros(2, 3),
            agg="token-mean",
            num_tokens=10,
            num_seqs=4,
            **kw,
        )
        assert loss.item() == 0.0
        assert all(math.isfinite(v) for v in m.values())
        assert m["tokens"] == 0.0
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.equal(g, torch.zeros(2, 3))
