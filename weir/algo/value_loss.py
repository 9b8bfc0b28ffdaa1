"""The critic's clipped value loss (PPO's value-function loss).

Shapes: ``values`` [B, T] (the critic's current predictions, with gradient), ``old_values``
[B, T] (the critic's predictions before this RL step's updates, the ones GAE used),
``returns`` [B, T] (GAE's value targets ``A + V_old``), ``mask`` [B, T] (1 = trained token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import (
    check_finite_where,
    check_float_tensor,
    check_mask,
    check_positive,
    check_shape,
    sanitize,
)

__all__ = ["ValueLoss", "value_loss"]


@dataclass(frozen=True)
class ValueLoss:
    """Output of :func:`value_loss`.

    Attributes:
        loss: scalar, ``coef * 0.5 * sum_{b,t} m L / N`` (see :func:`value_loss`); carries the
            gradient of ``values``.
        clipfrac_sum: number of trained tokens where the clipped term was the larger one, i.e.
            the clip bound the gradient (divide by ``N`` for the fraction).
        error_sum: ``sum m (V - G)^2`` over this micro-batch (unclipped), for metrics.
    """

    loss: Tensor
    clipfrac_sum: float
    error_sum: float


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    num_tokens: float,
    clip: float | None = 0.5,
    coef: float = 1.0,
) -> ValueLoss:
    """PPO's clipped value loss, token-mean over the whole mini-batch.

    With ``V`` the prediction, ``V_old`` the prediction GAE used, ``G`` the return and ``c``
    the clip range::

        V_clip = V_old + clamp(V - V_old, -c, c)
        L_t    = max((V - G)^2, (V_clip - G)^2)
        loss   = coef * 0.5 * sum_{b,t} m[b, t] L[b, t] / N

    ``N = num_tokens`` is the trained-token count of the whole mini-batch (all micro-batches),
    so summing the micro-batch losses gives the same gradient however the mini-batch was split.
    ``clip=None`` gives the plain squared error ``L_t = (V - G)^2``. This is verl's
    ``compute_value_loss`` and OpenRLHF's ``ValueLoss`` (both take the max of the two terms).
    Positions with ``mask = 0`` are never read.

    Raises:
        ValueError: shape mismatch, non-positive ``num_tokens`` or ``clip``, NaN/inf at a
            trained position.
    """
    values = check_float_tensor("values", values, ndim=2)
    m = check_mask("mask", mask, values.shape)
    for name, t in (("old_values", old_values), ("returns", returns)):
        check_float_tensor(name, t, ndim=2)
        check_shape(name, t, tuple(values.shape), "same as values")
    n = check_positive("num_tokens", num_tokens)
    if clip is not None:
        clip = check_positive("clip", clip)
    check_finite_where({"values": values, "old_values": old_values, "returns": returns}, m)
    old = sanitize(old_values.detach().to(values.dtype), m)
    target = sanitize(returns.detach().to(values.dtype), m)
    v = sanitize(values, m)
    unclipped = (v - target) ** 2
    if clip is None:
        per_token = unclipped
        clipped_more = torch.zeros_like(m)
    else:
        v_clip = old + (v - old).clamp(-clip, clip)
        clipped = (v_clip - target) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_more = (clipped > unclipped) & m
    loss = coef * 0.5 * sanitize(per_token, m).sum() / n
    return ValueLoss(
        loss=loss,
        clipfrac_sum=float(clipped_more.sum().item()),
        error_sum=float(sanitize(unclipped.detach(), m).sum().item()),
    )
