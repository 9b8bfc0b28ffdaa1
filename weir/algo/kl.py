"""KL estimators and KL coefficient controllers.

The estimators follow J. Schulman, "Approximating KL divergence" (2020,
http://joschu.net/blog/kl-approx.html). With samples drawn from the current policy
``pi`` and ``log r = ref_logp - logp`` (so ``r = pi_ref / pi``), each estimates
``KL(pi || pi_ref)`` per token:

* ``k1 = -log r = logp - ref_logp`` (unbiased, high variance, can be negative)
* ``k2 = (log r)^2 / 2`` (biased, low variance, >= 0)
* ``k3 = (r - 1) - log r`` (unbiased, low variance, >= 0)

Use them as a loss term (``kl_coef`` in :func:`weir.algo.compute_policy_loss`) or as a
per-token reward penalty (:func:`kl_token_rewards` with a :class:`FixedKLController` or
:class:`AdaptiveKLController` coefficient, passed as ``token_rewards`` to
:func:`weir.algo.compute_advantages`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor

from ._checks import (
    check_finite_number,
    check_float_tensor,
    check_mask,
    check_positive,
    check_shape,
    sanitize,
)
from .registry import suggest

__all__ = [
    "KL_KINDS",
    "kl_penalty",
    "kl_token_rewards",
    "AdaptiveKLController",
    "FixedKLController",
    "make_kl_controller",
]

KL_KINDS = ("k1", "k2", "k3")
KLKind = Literal["k1", "k2", "k3"]

K3_INPUT_CLAMP = 20.0
K3_OUTPUT_CLAMP = 10.0


def _check_kind(kind: str) -> str:
    if kind not in KL_KINDS:
        raise ValueError(
            f"kind: unknown KL estimator {kind!r}; valid: {', '.join(KL_KINDS)}{suggest(str(kind), KL_KINDS)}"
        )
    return kind


def kl_penalty(
    logp: Tensor, ref_logp: Tensor, kind: KLKind = "k3", *, mask: Tensor | None = None
) -> Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman 2020).

    With ``d = ref_logp - logp``:

    * ``k1 = -d``
    * ``k2 = d^2 / 2``
    * ``k3 = exp(d') - d' - 1`` with ``d' = clamp(d, -20, 20)``, then the result clamped
      to ``[-10, 10]`` (the same bounds as verl's ``low_var_kl``).

    Gradients flow to both arguments (detach ``ref_logp`` yourself if it is a tensor that
    requires grad). With ``mask``, positions where it is 0 are exactly 0 and their inputs
    are never read.

    Raises:
        ValueError: unknown ``kind``; shapes differ; non-float inputs.
    """
    _check_kind(kind)
    check_float_tensor("logp", logp)
    check_float_tensor("ref_logp", ref_logp)
    check_shape("ref_logp", ref_logp, logp.shape, "same as logp")
    m = None
    if mask is not None:
        m = check_mask("mask", mask, logp.shape) if logp.dim() == 2 else mask.bool()
        logp, ref_logp = sanitize(logp, m), sanitize(ref_logp, m)
    d = ref_logp - logp
    if kind == "k1":
        out = -d
    elif kind == "k2":
        out = 0.5 * d.square()
    else:
        d = d.clamp(-K3_INPUT_CLAMP, K3_INPUT_CLAMP)
        out = (torch.exp(d) - d - 1).clamp(-K3_OUTPUT_CLAMP, K3_OUTPUT_CLAMP)
    return out if m is None else sanitize(out, m)


def kl_token_rewards(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, *, coef: float, kind: KLKind = "k1"
) -> Tensor:
    """Per-token reward penalty ``-coef * kl_penalty(logp, ref_logp, kind)``, 0 where masked.

    Detached; pass it as ``token_rewards`` to :func:`weir.algo.compute_advantages`. The
    default estimator is ``k1``, the one used by Ziegler et al. (2019) and InstructGPT
    for the reward penalty. ``coef`` is typically a controller's ``.value``.
    """
    coef = check_finite_number("coef", coef)
    with torch.no_grad():
        return -coef * kl_penalty(logp.detach(), ref_logp.detach(), kind, mask=mask)


class FixedKLController:
    """A constant KL coefficient: ``value`` never changes (``update`` is a no-op)."""

    def __init__(self, coef: float) -> None:
        self.value = check_positive("coef", coef, allow_zero=True)

    def update(self, current_kl: float, n_steps: int) -> float:
        """No-op; returns ``value``."""
        return self.value

    def state_dict(self) -> dict[str, Any]:
        """Serializable state, for checkpoints."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value})"


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences"; the same rule as verl and OpenRLHF).

    After each batch with measured KL ``kl`` over ``n_steps`` samples::

        e = clip(kl / target - 1, -0.2, 0.2)
        value <- value * (1 + e * n_steps / horizon)

    The coefficient grows when the policy drifts further than ``target`` from the
    reference and shrinks when it stays closer.

    Args:
        init_coef: starting coefficient (> 0).
        target: target KL (> 0), in the units of the ``kl`` passed to `update`. weir's actor passes
            the batch's mean KL per trained token (``kl/ref``, as verl does), so ``algo.kl.
            adaptive_target`` is per token; Ziegler et al.'s 6.0 was a KL per *sample* (a sum over
            its tokens), which per token is about 6.0 / mean response length.
        horizon: number of samples over which the error is corrected (> 0), e.g. 10000.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        self.value = check_positive("init_coef", init_coef)
        self.target = check_positive("target", target)
        self.horizon = check_positive("horizon", horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Apply one update and return the new ``value``.

        Raises:
            ValueError: ``current_kl`` is NaN/inf or ``n_steps`` is negative.
        """
        current_kl = check_finite_number("current_kl", current_kl)
        n_steps_f = check_positive("n_steps", n_steps, allow_zero=True)
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps_f / self.horizon
        if not math.isfinite(self.value) or self.value <= 0:
            raise ValueError(
                f"AdaptiveKLController: coefficient became {self.value}; n_steps / horizon "
                f"= {n_steps_f / self.horizon} is too large (expected well below 5)"
            )
        return self.value

    def state_dict(self) -> dict[str, Any]:
        """Serializable state, for checkpoints."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self.value}, target={self.target}, "
            f"horizon={self.horizon})"
        )


def make_kl_controller(
    kind: Literal["fixed", "adaptive"],
    coef: float,
    *,
    target: float | None = None,
    horizon: float | None = None,
) -> FixedKLController | AdaptiveKLController:
    """``FixedKLController(coef)`` or ``AdaptiveKLController(coef, target, horizon)``."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        if target is None or horizon is None:
            raise ValueError("adaptive KL controller: expected both target= and horizon=")
        return AdaptiveKLController(coef, target, horizon)
    raise ValueError(
        f"kind: unknown KL controller {kind!r}; valid: fixed, adaptive{suggest(str(kind), ['fixed', 'adaptive'])}"
    )
