"""Loss aggregation: hand values and micro-batch split invariance."""

from __future__ import annotations

import pytest
import torch

from weir.algo import AGG_MODES, POLICY_LOSSES, aggregate_loss, compute_policy_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 3.0),  # (1+2+3+4+5) / 5
        ("seq-mean-token-sum", 7.5),  # (6 + 9) / 2
        ("seq-mean-token-mean", 3.25),  # (6/3 + 9/2) / 2
        ("seq-mean-token-sum-norm", 1.875),  # (6 + 9) / (2 * 4)
    ],
)
def test_hand_values(mode, expected):
    out = aggregate_loss(LOSS, MASK, mode, num_tokens=5, num_seqs=2, max_len=4)
    assert out.item() == pytest.approx(expected, abs=1e-6)


def test_global_counts_not_local_ones():
    # the same tensor, but it is one half of a batch of 10 tokens / 4 sequences
    assert aggregate_loss(LOSS, MASK, "token-mean", num_tokens=10, num_seqs=4).item() == 1.5
    assert (
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum", num_tokens=10, num_seqs=4).item() == 3.75
    )


def test_masked_values_are_ignored_even_nan():
    loss = LOSS.clone()
    loss[1, 2] = float("nan")
    out = aggregate_loss(loss, MASK, "token-mean", num_tokens=5, num_seqs=2)
    assert out.item() == 3.0


def test_empty_mask_row_in_seq_mean_token_mean():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    out = aggregate_loss(LOSS, mask, "seq-mean-token-mean", num_tokens=3, num_seqs=1)
    assert out.item() == 2.0


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = 8, 7
    lengths = torch.tensor([7, 3, 5, 1, 6, 2, 7, 4])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    mask[2, 1] = 0  # a tool-output token in the middle
    mask[4:6] = 0  # samples with no trained token: with 4 micro-batches one is all masked
    base = torch.randn(B, T, generator=g) * 0.5 - 2.0
    old = base + 0.3 * torch.randn(B, T, generator=g)
    behav = old + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    ref = base + 0.1 * torch.randn(B, T, generator=g)
    weights = torch.rand(B, T, generator=g) + 0.5
    return base, old, behav, adv, ref, weights, mask


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_split_invariance(name, mode):
    base, old, behav, adv, ref, weights, mask = _batch()
    num_tokens = mask.sum().item()
    num_seqs = float((mask.sum(1) > 0).sum().item())
    max_len = 7
    extra = {"eps_low": 0.1, "eps_high": 0.1}
    if name == "decoupled_ppo":
        extra["behavior_logp"] = behav
    if name == "reinforce":
        extra = {}
    if name in ("gspo",):
        extra = {"eps_low": 0.02, "eps_high": 0.02}

    def run(n_micro: int):
        theta = base.clone().requires_grad_()
        total = torch.zeros(())
        for rows in torch.arange(8).chunk(n_micro):
            m = mask[rows]
            # each micro-batch is trimmed to its own longest row: T differs between them
            cols = m.any(0).nonzero()
            width = int(cols.max()) + 1 if cols.numel() else 1
            sl = (rows, slice(0, width))
            kw = {k: (v[sl] if isinstance(v, torch.Tensor) else v) for k, v in extra.items()}
            loss, _ = compute_policy_loss(
                name,
                theta[sl],
                old[sl],
                adv[sl],
                m[:, :width],
                agg=mode,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                max_len=max_len,
                weights=weights[sl],
                ref_logp=ref[sl],
                kl_coef=0.05,
                **kw,
            )
            total = total + loss
        total.backward()
        return total.detach(), theta.grad

    ref_loss, ref_grad = run(1)
    assert ref_grad.abs().sum() > 0
    for n in (2, 4):
        loss, grad = run(n)
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_loss_split_invariance(mode):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 5, generator=g, requires_grad=True)
    mask = (torch.rand(8, 5, generator=g) > 0.3).float()
    kw = dict(num_tokens=mask.sum().item(), num_seqs=8, max_len=5)
    full = aggregate_loss(x**2, mask, mode, **kw)
    (g_full,) = torch.autograd.grad(full, x)
    for n in (2, 4):
        parts = sum(
            aggregate_loss(x[r] ** 2, mask[r], mode, **kw) for r in torch.arange(8).chunk(n)
        )
        (g_parts,) = torch.autograd.grad(parts, x)
        torch.testing.assert_close(parts, full, atol=1e-6, rtol=0)
        torch.testing.assert_close(g_parts, g_full, atol=1e-6, rtol=0)
