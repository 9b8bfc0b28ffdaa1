"""On-policy distillation's reverse-KL advantages and loss, against hand and closed-form values."""

from __future__ import annotations

import pytest
import torch

from weir.algo import (
    aggregate_loss,
    compute_policy_loss,
    reverse_kl,
    reverse_kl_advantages,
    reverse_kl_loss,
)

STUDENT = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, float("nan")]])
TEACHER = torch.tensor([[-0.7, -0.2, -2.0], [-0.4, -1.0, 0.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 0]])


def test_reverse_kl_hand_values():
    # k = student - teacher on the sampled tokens; masked positions (even NaN) are 0
    torch.testing.assert_close(
        reverse_kl(STUDENT, TEACHER, MASK), torch.tensor([[0.2, -0.8, 0.0], [0.3, -2.0, 0.0]])
    )


def test_advantages_hand_values():
    adv = reverse_kl_advantages(STUDENT, TEACHER, MASK)
    torch.testing.assert_close(adv, torch.tensor([[-0.2, 0.8, 0.0], [-0.3, 2.0, 0.0]]))
    # mixed: A = 2 * A_task - 0.5 * k with A_task = +0.5 (row 0) and -1 (row 1)
    task = torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, -1.0]])
    adv = reverse_kl_advantages(
        STUDENT, TEACHER, MASK, coef=0.5, task_advantages=task, task_weight=2.0
    )
    torch.testing.assert_close(adv, torch.tensor([[0.9, 1.4, 0.0], [-2.15, -1.0, 0.0]]))


def test_a_student_equal_to_its_teacher_gets_zero():
    lp = torch.log(torch.rand(3, 5, generator=torch.Generator().manual_seed(1)))
    assert reverse_kl_advantages(lp, lp.clone(), torch.ones(3, 5)).abs().max() == 0


def _tabular(seed: int, t: int = 4, v: int = 6):
    """A student whose parameters are its logits z [T, V] (one distribution per position), a teacher
    q [T, V], and one sampled token per position."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(t, v, generator=g, dtype=torch.float64).requires_grad_(True)
    q = torch.randn(t, v, generator=g, dtype=torch.float64).log_softmax(-1)
    y = torch.randint(0, v, (t,), generator=g)
    return z, q, y


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("way", ["advantage", "loss"])
def test_gradient_equals_the_closed_form(seed, way):
    """d/dz of the token-mean loss: (1/T) sum_t k_t (onehot(y_t) - pi_t), since
    d log softmax(z)_y / dz = onehot(y) - softmax(z)."""
    z, q, y = _tabular(seed)
    t = len(y)
    logp = z.log_softmax(-1).gather(1, y[:, None]).T  # [1, T]
    teacher = q.gather(1, y[:, None]).T
    mask = torch.ones(1, t)
    if way == "advantage":
        adv = reverse_kl_advantages(logp.detach(), teacher, mask)
        loss, _ = compute_policy_loss(
            "ppo", logp, logp.detach(), adv, mask, agg="token-mean", num_tokens=t, num_seqs=1
        )
    else:
        per_tok = reverse_kl_loss(logp, teacher, mask)
        loss = aggregate_loss(per_tok, mask, "token-mean", num_tokens=t, num_seqs=1)
    loss.backward()
    pi = z.detach().softmax(-1)
    k = (logp.detach() - teacher)[0]
    expected = (k[:, None] * (torch.nn.functional.one_hot(y, pi.shape[1]) - pi)) / t
    torch.testing.assert_close(z.grad, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_expected_gradient_is_the_reverse_kl_gradient(seed):
    """Averaged over every token the student can sample (weights pi(v)), the estimator's gradient
    at one position equals grad_z KL(pi || q), computed by autograd from the exact KL."""
    z, q, _ = _tabular(seed, t=1, v=7)
    v = z.shape[1]
    total = torch.zeros_like(z)
    pi = z.detach().softmax(-1)
    for tok in range(v):
        zz = z.detach().clone().requires_grad_(True)
        logp = zz.log_softmax(-1)[:, tok][None]
        per_tok = reverse_kl_loss(logp, q[:, tok][None], torch.ones(1, 1))
        per_tok.sum().backward()
        total += pi[0, tok] * zz.grad
    exact = z.detach().clone().requires_grad_(True)
    p = exact.softmax(-1)
    (p * (exact.log_softmax(-1) - q)).sum().backward()
    torch.testing.assert_close(total, exact.grad, atol=1e-12, rtol=0)


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="teacher_logp: expected shape"):
        reverse_kl(STUDENT, TEACHER[:, :2], MASK)
    with pytest.raises(ValueError, match="teacher_logp"):
        reverse_kl(STUDENT, torch.full_like(TEACHER, float("inf")), MASK)
