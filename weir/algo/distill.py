"""On-policy distillation: the per-token reverse KL to a teacher on the student's own samples.

The student ``pi`` samples a response ``y``; a teacher ``q`` scores the same tokens. The reverse
KL of the student to the teacher at position t, ``KL(pi_t || q_t) = E_{v ~ pi_t}[log pi_t(v) - log
q_t(v)]``, is estimated from the one token the student sampled there:

    k_t = log pi(y_t | y_<t) - log q(y_t | y_<t)            (unbiased: y_t ~ pi_t)

the estimator of Tinker's cookbook (``-k_t`` is its per-token advantage, with no sum over later
tokens). TRL's GKD (``lmbda = 1``, ``beta = 1``) instead differentiates the exact per-position
reverse KL over the whole vocabulary, which needs the teacher's full logits (the same vocabulary,
the teacher beside the student); its gradient at each position is the expectation of this
estimator's over the token sampled there. The estimator's REINFORCE gradient,

    g = E_{y ~ pi}[ sum_t k_t grad log pi(y_t | y_<t) ],

equals ``grad_theta sum_t KL(pi_t || q_t)`` with the later positions' dependence on ``y_t``
dropped, the "discount 0" form these peers use: the student learns, token by token, to put its
mass where the teacher does (mode seeking), and each of its own mistakes is scored where it is
made, a dense signal that a sparse sequence reward does not give.

Two ways in:

* as an advantage (:func:`reverse_kl_advantages`): ``A_t = w_r A_task_t - c k_t``, through the
  policy loss (PPO's ratio and clip apply to it as to any advantage);
* as a loss term (:func:`reverse_kl_loss`): ``c * agg(sg(k_t) log pi(y_t))``, whose gradient is
  ``c * agg(k_t grad log pi(y_t))``, the same estimator without the ratio or clip.

(Differentiating ``agg(k_t)`` itself would be wrong: ``E_y[grad log pi(y)] = 0``, so that loss has
no expected gradient at all.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import (
    check_finite_number,
    check_finite_where,
    check_float_tensor,
    check_mask,
    check_shape,
    sanitize,
)

__all__ = ["reverse_kl", "reverse_kl_advantages", "reverse_kl_loss"]


def _checked(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    check_float_tensor("student_logp", student_logp, ndim=2)
    check_float_tensor("teacher_logp", teacher_logp, ndim=2)
    check_shape("teacher_logp", teacher_logp, student_logp.shape, "same as student_logp")
    m = check_mask("mask", mask, student_logp.shape)
    check_finite_where({"student_logp": student_logp, "teacher_logp": teacher_logp}, m)
    return m


def reverse_kl(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token reverse KL estimate ``k_t = student_logp_t - teacher_logp_t`` on the sampled
    tokens, 0 where `mask` is 0 (whose inputs are never read). Detached. [B, T] each."""
    m = _checked(student_logp, teacher_logp, mask)
    with torch.no_grad():
        return sanitize(student_logp.detach() - teacher_logp.detach().to(student_logp.dtype), m)


def reverse_kl_advantages(
    student_logp: Tensor,
    teacher_logp: Tensor,
    mask: Tensor,
    *,
    coef: float = 1.0,
    task_advantages: Tensor | None = None,
    task_weight: float = 0.0,
) -> Tensor:
    """Dense per-token advantages of on-policy distillation, mixed with a task's:

        A_t = task_weight * A_task_t - coef * (student_logp_t - teacher_logp_t)

    `student_logp`: log-probs of the sampled tokens under the policy that sampled them (the
    engine's, or the trainer's recomputed old ones); `teacher_logp`: the teacher's of the same
    tokens; `task_advantages`: e.g. GRPO's from the sparse reward (None: distillation alone).
    Detached, 0 where `mask` is 0. Pass the result as the advantages of
    :func:`weir.algo.compute_policy_loss`.
    """
    coef = check_finite_number("coef", coef)
    task_weight = check_finite_number("task_weight", task_weight)
    k = reverse_kl(student_logp, teacher_logp, mask)
    adv = -coef * k
    if task_advantages is not None and task_weight != 0.0:
        check_shape("task_advantages", task_advantages, k.shape, "same as student_logp")
        adv = adv + task_weight * sanitize(task_advantages.detach().to(k.dtype), mask.bool())
    return adv


def reverse_kl_loss(logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token surrogate ``sg(logp - teacher_logp) * logp`` of the reverse KL, 0 where masked:
    its gradient is ``(logp - teacher_logp) * grad logp``, the estimator of the module docstring.
    Aggregate it with :func:`weir.algo.aggregate_loss` and add ``coef`` times it to the loss.
    `logp` carries the gradient (the current policy's log-probs)."""
    m = _checked(logp, teacher_logp, mask)
    k = sanitize(logp.detach() - teacher_logp.detach().to(logp.dtype), m)
    return k * sanitize(logp, m)
