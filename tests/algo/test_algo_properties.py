"""Property tests: values at masked positions never change any output.

Every input is perturbed at the positions where the mask is 0 (with arbitrary values,
NaN and inf included); advantages, returns, losses, gradients, weights and metrics must
stay bit-for-bit identical.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weir.algo import (
    ADVANTAGES,
    AGG_MODES,
    CORRECTION_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    compute_advantages,
    compute_policy_loss,
    kl_penalty,
    rollout_correction,
)

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

junk = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0, 7.5, -3.0])


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    bits = draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))
    mask = torch.tensor(bits).reshape(B, T)
    if not mask.any():
        mask[draw(st.integers(0, B - 1)), draw(st.integers(0, T - 1))] = True
    seed = draw(st.integers(0, 2**31 - 1))
    fill = draw(junk)
    groups = torch.tensor(draw(st.lists(st.integers(0, 2), min_size=B, max_size=B)))
    return mask, seed, fill, groups


def rand(seed: int, shape, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale + shift


def perturb(x: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, fill))


@SETTINGS
@given(batches(), st.sampled_from(sorted(ADVANTAGES)))
def test_advantages_ignore_masked_positions(batch, name):
    mask, seed, fill, groups = batch
    B, T = mask.shape
    rewards = rand(seed, (B,))
    values = rand(seed + 1, (B, T))
    token_rewards = rand(seed + 2, (B, T), 0.1)
    kw = {"values": values} if name == "gae" else {}
    a = compute_advantages(name, rewards, mask, groups, token_rewards=token_rewards, **kw)
    kw2 = {"values": perturb(values, mask, fill)} if name == "gae" else {}
    b = compute_advantages(
        name, rewards, mask, groups, token_rewards=perturb(token_rewards, mask, fill), **kw2
    )
    assert torch.equal(a.advantages, b.advantages)
    assert (a.returns is None and b.returns is None) or torch.equal(a.returns, b.returns)
    assert torch.equal(a.mask, b.mask)
    assert a.metrics == b.metrics
    assert torch.isfinite(a.advantages).all()
    assert torch.equal(a.advantages[~mask], torch.zeros_like(a.advantages[~mask]))


@SETTINGS
@given(batches(), st.sampled_from(sorted(POLICY_LOSSES)), st.sampled_from(AGG_MODES))
def test_policy_losses_ignore_masked_positions(batch, name, agg):
    mask, seed, fill, _ = batch
    B, T = mask.shape
    logp = rand(seed, (B, T), 0.5, -2.0)
    old = logp + rand(seed + 1, (B, T), 0.2)
    behav = old + rand(seed + 2, (B, T), 0.2)
    adv = rand(seed + 3, (B, T))
    ref = logp + rand(seed + 4, (B, T), 0.1)
    weights = rand(seed + 5, (B, T)).abs()
    ent = rand(seed + 6, (B, T)).abs()

    def run(p: bool):
        f = (lambda x: perturb(x, mask, fill)) if p else (lambda x: x)
        leaf = f(logp).detach().clone().requires_grad_()
        kw = {"behavior_logp": f(behav)} if name == "decoupled_ppo" else {}
        loss, metrics = compute_policy_loss(
            name,
            leaf,
            f(old),
            f(adv),
            mask,
            agg=agg,
            num_tokens=float(mask.sum()),
            num_seqs=float(B),
            max_len=T,
            weights=f(weights),
            ref_logp=f(ref),
            kl_coef=0.1,
            entropy=f(ent),
            entropy_coef=0.01,
            **kw,
        )
        loss.backward()
        return loss.detach(), metrics, leaf.grad

    la, ma, ga = run(False)
    lb, mb, gb = run(True)
    assert torch.equal(la, lb)
    assert ma == mb
    assert torch.equal(ga, gb)
    assert torch.isfinite(la) and torch.isfinite(ga).all()
    assert torch.equal(ga[~mask], torch.zeros_like(ga[~mask]))


@SETTINGS
@given(batches(), st.sampled_from(CORRECTION_MODES))
def test_rollout_correction_ignores_masked_positions(batch, mode):
    mask, seed, fill, _ = batch
    B, T = mask.shape
    train = rand(seed, (B, T), 0.5, -2.0)
    roll = train + rand(seed + 1, (B, T), 0.3)
    a = rollout_correction(train, roll, mask, mode=mode, cap=1.2, low=0.8, high=1.25)
    b = rollout_correction(
        perturb(train, mask, fill),
        perturb(roll, mask, -fill if fill == fill else fill),
        mask,
        mode=mode,
        cap=1.2,
        low=0.8,
        high=1.25,
    )
    assert torch.equal(a.weights, b.weights)
    assert torch.equal(a.mask, b.mask)
    assert a.metrics == b.metrics
    assert torch.isfinite(a.weights).all()


@SETTINGS
@given(batches(), st.sampled_from(AGG_MODES), st.sampled_from(["k1", "k2", "k3"]))
def test_aggregate_and_kl_ignore_masked_positions(batch, agg, kind):
    mask, seed, fill, _ = batch
    B, T = mask.shape
    x = rand(seed, (B, T))
    y = rand(seed + 1, (B, T))
    kw = dict(num_tokens=float(mask.sum()), num_seqs=float(B), max_len=T)
    assert torch.equal(
        aggregate_loss(x, mask, agg, **kw), aggregate_loss(perturb(x, mask, fill), mask, agg, **kw)
    )
    assert torch.equal(
        kl_penalty(x, y, kind, mask=mask),
        kl_penalty(perturb(x, mask, fill), perturb(y, mask, fill), kind, mask=mask),
    )
