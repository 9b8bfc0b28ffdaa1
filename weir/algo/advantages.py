"""Advantage estimators and :func:`compute_advantages`, the validated front door.

Shapes: ``rewards`` [B] (one outcome reward per sample), ``mask`` [B, T] (1 = trained
response token, 0 = padding / tool output / observation), ``group_ids`` [B] (samples of
the same prompt share an id), optional ``values`` and ``token_rewards`` [B, T].

Every estimator has the signature::

    fn(rewards, mask, group_ids, *, [values=...,] [token_rewards=...,] **options)
        -> AdvantageResult | (advantages, returns) | advantages

and is called by :func:`compute_advantages` only on samples with a finite reward, with a
bool ``mask`` and with ``values`` / ``token_rewards`` zeroed where the mask is 0 (they
are passed only when given). User estimators with that signature plug in by dotted path.

Call :func:`compute_advantages` once on the whole optimizer batch (all ranks' samples),
before splitting into micro-batches: group statistics and whitening are batch-wide.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ._checks import (
    check_finite_number,
    check_finite_where,
    check_float_tensor,
    check_mask,
    check_positive,
    check_shape,
    check_tensor,
    masked_max,
    masked_mean,
    masked_min,
    sanitize,
)
from .registry import Registry, call_with_options, resolve

__all__ = [
    "ADVANTAGES",
    "AdvantageResult",
    "compute_advantages",
    "grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "gae",
    "masked_whiten",
    "discounted_returns",
    "place_outcome_rewards",
]

ADVANTAGES = Registry("advantage estimator")


@dataclass(frozen=True)
class AdvantageResult:
    """Output of an advantage estimator.

    Attributes:
        advantages: [B, T], 0 wherever ``mask`` is 0; detached.
        returns: [B, T] value targets / discounted returns (token-level estimators), or
            None (sequence-level estimators).
        metrics: python floats.
        mask: [B, T] bool, the input mask with the samples whose reward was NaN/inf
            removed. Filled by :func:`compute_advantages`; use it (not the input mask)
            for the loss and for the global token / sequence counts.
    """

    advantages: Tensor
    returns: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    mask: Tensor | None = None


# ---------------------------------------------------------------- helpers


@dataclass(frozen=True)
class _GroupStats:
    n: Tensor
    s: Tensor
    mean: Tensor
    var: Tensor
    metrics: dict[str, Tensor]


def _group_stats(r: Tensor, group_ids: Tensor) -> _GroupStats:
    """Per-sample count, sum, mean and unbiased variance of its group.

    The variance is 0 for a group of one. A group whose rewards are all equal gets its
    mean set to that exact value, so that ``r - mean`` is exactly 0 (``sum / n`` can be
    off by one ulp, which the std normalisation would blow up).
    """
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max().item()) + 1
    zeros = torch.zeros(g, dtype=r.dtype, device=r.device)
    n = zeros.index_add(0, inv, torch.ones_like(r))
    s = zeros.index_add(0, inv, r)
    hi = zeros.scatter_reduce(0, inv, r, reduce="amax", include_self=False)
    lo = zeros.scatter_reduce(0, inv, r, reduce="amin", include_self=False)
    mean = torch.where(hi == lo, hi, s / n)
    sq = zeros.index_add(0, inv, (r - mean[inv]) ** 2)
    var = torch.where(n > 1, sq / (n - 1).clamp(min=1), zeros)
    metrics = {
        "groups": n.new_tensor(float(g)),
        "singleton_groups": (n == 1).sum().to(r.dtype),
        "zero_std_groups": ((n > 1) & (var == 0)).sum().to(r.dtype),
    }
    return _GroupStats(n[inv], s[inv], mean[inv], var[inv], metrics)


def _sequence_rewards(rewards: Tensor, mask: Tensor, token_rewards: Tensor | None) -> Tensor:
    if token_rewards is None:
        return rewards
    return rewards + sanitize(token_rewards, mask).sum(dim=1).to(rewards.dtype)


def place_outcome_rewards(
    rewards: Tensor, mask: Tensor, token_rewards: Tensor | None = None
) -> Tensor:
    """Token-level reward tensor R [B, T].

    ``R[b, t] = token_rewards[b, t] * mask[b, t] + rewards[b] * [t == last(b)]`` where
    ``last(b)`` is the last position with ``mask = 1`` in row ``b``. A row without any
    trained token receives no reward.
    """
    B, T = mask.shape
    R = (
        sanitize(token_rewards, mask).to(rewards.dtype)
        if token_rewards is not None
        else torch.zeros(B, T, dtype=rewards.dtype, device=rewards.device)
    )
    last = (T - 1) - mask.flip(1).to(torch.int32).argmax(dim=1)
    has_any = mask.any(dim=1)
    outcome = torch.where(has_any, rewards, torch.zeros_like(rewards))
    return R.scatter_add(1, last.unsqueeze(1), outcome.unsqueeze(1))


def discounted_returns(x: Tensor, mask: Tensor, discount: float) -> Tensor:
    """Reverse discounted sum over the masked-in positions of each row.

    ``G_t = x_t + discount * G_{t'}`` where ``t'`` is the next position after ``t`` with
    ``mask = 1`` (0 after the last one). Positions with ``mask = 0`` are skipped, not
    treated as steps; their output is 0. Each row is its own sequence, so the sum resets
    at every sequence end.
    """
    x = sanitize(x, mask)
    if discount == 1.0:
        out = x.flip(1).cumsum(dim=1).flip(1)
        return sanitize(out, mask)
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[:, 0])
    for t in range(x.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], x[:, t] + discount * running, running)
        out[:, t] = running
    return sanitize(out, mask)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over all masked-in positions; 0 elsewhere.

    ``mean`` and the unbiased ``var`` (divisor N - 1, 0 when N = 1) are taken over every
    position with ``mask = 1`` in the tensor, i.e. over the whole batch.
    """
    n = mask.sum().to(x.dtype)
    xs = sanitize(x, mask)
    mean = xs.sum() / n.clamp(min=1)
    centered = sanitize(x - mean, mask)
    var = (centered**2).sum() / (n - 1).clamp(min=1)
    return centered * torch.rsqrt(var + eps)


# ---------------------------------------------------------------- estimators


@ADVANTAGES.register("grpo")
def grpo(
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    *,
    token_rewards: Tensor | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> AdvantageResult:
    """GRPO group-normalised outcome advantage (Shao et al. 2024, DeepSeekMath).

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with the group mean and the *unbiased*
    (N - 1) standard deviation of the finite rewards of the sample's group, broadcast to
    every trained token (``A_i * mask``).

    ``norm_by_std=False`` gives Dr.GRPO (Liu et al. 2025): ``A_i = r_i - mean_g``.
    A group of one sample gets ``A = 0``; a group whose rewards are all equal gets 0.
    ``token_rewards`` (e.g. a KL penalty) are summed over the trained tokens into the
    sample's reward first.

    Options: ``norm_by_std=True``, ``eps=1e-6`` (added to the std, outside the sqrt).
    Returns: ``returns=None``.
    """
    eps = check_positive("eps", eps)
    r = _sequence_rewards(rewards, mask, token_rewards)
    gs = _group_stats(r, group_ids)
    centered = r - gs.mean
    adv = centered / (gs.var.sqrt() + eps) if norm_by_std else centered
    adv = torch.where(gs.n > 1, adv, torch.zeros_like(adv))
    return AdvantageResult(sanitize(adv.unsqueeze(1).expand_as(mask), mask), None, gs.metrics)


@ADVANTAGES.register("rloo")
def rloo(
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    *,
    token_rewards: Tensor | None = None,
) -> AdvantageResult:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics").

    ``A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1)``, i.e. the reward minus the
    mean of the *other* samples of its group, broadcast to every trained token. Equal to
    ``n_g / (n_g - 1) * (r_i - mean_g)``. A group of one gets ``A = 0``.
    ``token_rewards`` are summed into the sample's reward first. No options.
    """
    r = _sequence_rewards(rewards, mask, token_rewards)
    gs = _group_stats(r, group_ids)
    baseline = (gs.s - r) / (gs.n - 1).clamp(min=1)
    adv = torch.where(gs.n > 1, r - baseline, torch.zeros_like(r))
    return AdvantageResult(sanitize(adv.unsqueeze(1).expand_as(mask), mask), None, gs.metrics)


def _check_unit(name: str, v: float) -> float:
    v = check_finite_number(name, v)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name}: expected a number in [0, 1], got {v!r}")
    return v


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    *,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    whiten: bool = True,
    eps: float = 1e-8,
) -> AdvantageResult:
    """REINFORCE++ (Hu 2025): discounted token return, whitened over the batch.

    ``R`` = ``token_rewards`` plus the outcome reward on the last trained token;
    ``G_t = R_t + gamma * G_{t'}`` over the trained tokens of the row (``t'`` = next
    trained token; masked positions are skipped, the sum resets at each sequence end);
    ``A = (G - mean) / sqrt(var + eps)`` with mean and unbiased variance over every
    trained token of the batch.

    Options: ``gamma=1.0``, ``whiten=True``, ``eps=1e-8`` (inside the sqrt).
    Returns: ``returns = G`` (before whitening).
    """
    gamma = _check_unit("gamma", gamma)
    eps = check_positive("eps", eps)
    G = discounted_returns(place_outcome_rewards(rewards, mask, token_rewards), mask, gamma)
    adv = masked_whiten(G, mask, eps) if whiten else G
    return AdvantageResult(adv, G, {})


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline(
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    *,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    whiten: bool = True,
    eps: float = 1e-8,
) -> AdvantageResult:
    """REINFORCE++-baseline (Hu 2025): group-mean baseline, then batch whitening.

    ``r'_i = r_i - mean_g`` (a group of one gets ``r' = 0``); then exactly
    :func:`reinforce_pp` with ``r'`` as the outcome reward: ``token_rewards`` added per
    token, discounted return with ``gamma``, whitened over every trained token of the
    batch. Without ``token_rewards`` and with ``gamma = 1`` every token of sample ``i``
    holds ``r'_i`` before whitening.

    Options: ``gamma=1.0``, ``whiten=True``, ``eps=1e-8`` (inside the sqrt).
    Returns: ``returns = G`` (before whitening).
    """
    gs = _group_stats(rewards, group_ids)
    shifted = torch.where(gs.n > 1, rewards - gs.mean, torch.zeros_like(rewards))
    out = reinforce_pp(
        shifted, mask, group_ids, token_rewards=token_rewards, gamma=gamma, whiten=whiten, eps=eps
    )
    return AdvantageResult(out.advantages, out.returns, gs.metrics)


@ADVANTAGES.register("gae")
def gae(
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    *,
    values: Tensor,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    eps: float = 1e-8,
) -> AdvantageResult:
    """Generalised Advantage Estimation (Schulman et al. 2016), token level, with a critic.

    ``R`` = ``token_rewards`` plus the outcome reward on the last trained token. Over the
    trained tokens of each row, with ``t'`` the next trained token after ``t`` and
    ``V_{t'} = 0`` after the last one::

        delta_t = R_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}

    Masked positions (tool output, observations in multi-turn episodes, padding) are
    skipped by the recursion: they are not zero-reward steps and do not discount.
    ``returns = A + V`` is taken before whitening; then, when ``whiten``, ``A`` is
    whitened over every trained token of the batch (unbiased variance, eps inside sqrt).

    Options: ``gamma=1.0``, ``lam=1.0``, ``whiten=True``, ``eps=1e-8``.
    """
    gamma = _check_unit("gamma", gamma)
    lam = _check_unit("lam", lam)
    eps = check_positive("eps", eps)
    B, T = mask.shape
    V = sanitize(values.to(rewards.dtype), mask)
    R = place_outcome_rewards(rewards, mask, token_rewards)
    pos = torch.where(mask, torch.arange(T, device=mask.device).expand(B, T), T)
    after = torch.cat([pos[:, 1:], torch.full((B, 1), T, device=mask.device)], dim=1)
    nxt = after.flip(1).cummin(dim=1).values.flip(1)
    V_next = torch.cat([V, torch.zeros(B, 1, dtype=V.dtype, device=V.device)], dim=1).gather(1, nxt)
    delta = R + gamma * V_next - V
    adv = discounted_returns(delta, mask, gamma * lam)
    returns = sanitize(adv + V, mask)
    if whiten:
        adv = masked_whiten(adv, mask, eps)
    return AdvantageResult(adv, returns, {})


# ---------------------------------------------------------------- front door


def _as_result(out: Any, who: str) -> AdvantageResult:
    if isinstance(out, AdvantageResult):
        return out
    if isinstance(out, Tensor):
        return AdvantageResult(out)
    if isinstance(out, tuple) and len(out) in (2, 3):
        return AdvantageResult(*out)
    raise ValueError(
        f"advantage estimator {who!r} returned {type(out).__name__}; expected AdvantageResult, "
        "(advantages, returns[, metrics]) or an advantages tensor"
    )


def _name(name_or_fn: str | Callable[..., Any]) -> str:
    if isinstance(name_or_fn, str):
        return name_or_fn
    return getattr(name_or_fn, "__qualname__", repr(name_or_fn))


def compute_advantages(
    name_or_fn: str | Callable[..., Any],
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    *,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    **options: Any,
) -> AdvantageResult:
    """Validate the batch, drop non-finite rewards, run an estimator, report metrics.

    Args:
        name_or_fn: a name in :data:`ADVANTAGES` (``grpo``, ``rloo``, ``reinforce_pp``,
            ``reinforce_pp_baseline``, ``gae``), a dotted path or a callable.
        rewards: [B] float outcome rewards.
        mask: [B, T] 0/1 (bool, int or float) response mask; 1 = trained token.
        group_ids: [B] integer group (prompt) ids.
        values: [B, T] critic values (``gae`` only).
        token_rewards: [B, T] per-token rewards (e.g. ``-coef * kl``) added on top of the
            outcome reward; sequence-level estimators sum them into the sample reward.
        **options: estimator options (e.g. ``norm_by_std=False``, ``gamma=0.99``); an
            option the estimator does not take is a ValueError.

    Bad input:
        ValueError for a wrong type/shape/dtype, an empty batch, a mask with values other
        than 0/1 or that selects no token, NaN/inf in ``values``/``token_rewards`` at a
        trained position, or an unknown option. A NaN/inf *reward* excludes its sample:
        the estimator runs on the other samples (group statistics and whitening do not see
        it), its advantages and returns are 0, it is removed from ``result.mask``, and it
        is counted in ``metrics["nonfinite_rewards"]``. If no sample with a trained token
        is left, ValueError. Values at masked positions are never read.

    Returns:
        :class:`AdvantageResult` with detached ``advantages`` [B, T], ``returns``
        [B, T] or None, ``mask`` (effective, bool) and float ``metrics``: reward_mean,
        reward_std, adv_mean, adv_std, adv_min, adv_max (over trained tokens),
        nonfinite_rewards, excluded_tokens, plus the estimator's own (e.g. groups,
        singleton_groups, zero_std_groups, returns_mean).
    """
    fn = resolve(name_or_fn, ADVANTAGES)
    who = _name(name_or_fn)
    rewards = check_float_tensor("rewards", rewards, ndim=1)
    if rewards.shape[0] == 0:
        raise ValueError("rewards: empty batch (expected at least one sample)")
    m = check_mask("mask", mask)
    B, T = m.shape
    check_shape("rewards", rewards, (B,), "one reward per sample, B = mask.shape[0]")
    group_ids = check_tensor("group_ids", group_ids)
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids: expected an integer tensor, got dtype {group_ids.dtype}")
    check_shape("group_ids", group_ids, (B,), "one group id per sample")
    extras = {"values": values, "token_rewards": token_rewards}
    for k, v in extras.items():
        if v is not None:
            check_float_tensor(k, v, ndim=2)
            check_shape(k, v, (B, T), "same as mask")
    if not bool(m.any()):
        raise ValueError("mask: selects no token (expected at least one 1)")
    extras = {k: None if v is None else v.to(m.device) for k, v in extras.items()}
    check_finite_where(extras, m)

    dtype = torch.promote_types(rewards.dtype, torch.float32)
    with torch.no_grad():
        rewards = rewards.detach().to(device=m.device, dtype=dtype)
        group_ids = group_ids.to(m.device)
        finite = torch.isfinite(rewards)
        n_bad = int((~finite).sum().item())
        m_eff = m & finite.unsqueeze(1) if n_bad else m
        if n_bad and not bool(m_eff.any()):
            raise ValueError(
                f"rewards: {n_bad} of {B} rewards are NaN/inf and the samples left have no "
                "trained token; nothing to learn from this batch"
            )
        idx = finite.nonzero().squeeze(1) if n_bad else None

        def sub(x: Tensor) -> Tensor:
            return x if idx is None else x.index_select(0, idx)

        m_sub = sub(m)
        kwargs: dict[str, Any] = {
            k: sub(sanitize(v.detach().to(dtype), m)) for k, v in extras.items() if v is not None
        }
        out = _as_result(
            call_with_options(
                fn,
                (sub(sanitize(rewards, finite)), m_sub, sub(group_ids)),
                {**kwargs, **options},
                kind="advantage estimator",
            ),
            who,
        )
        nb = m_sub.shape[0]
        for k, t in (("advantages", out.advantages), ("returns", out.returns)):
            if t is None:
                continue
            check_tensor(f"{who} {k}", t)
            check_shape(f"{who} {k}", t, (nb, T), "same as mask")
        check_finite_where(
            {f"{who} advantages": out.advantages, f"{who} returns": out.returns}, m_sub
        )

        def full(t: Tensor) -> Tensor:
            t = t.detach().to(dtype)
            if idx is not None:
                t = torch.zeros(B, T, dtype=dtype, device=t.device).index_copy_(0, idx, t)
            return sanitize(t, m_eff)

        adv = full(out.advantages)
        ret = full(out.returns) if out.returns is not None else None

        rv = rewards[finite]
        stats: dict[str, Tensor] = {
            "reward_mean": rv.mean(),
            "reward_std": rv.std() if rv.numel() > 1 else rv.new_zeros(()),
            "adv_mean": masked_mean(adv, m_eff),
            "adv_std": masked_mean((adv - masked_mean(adv, m_eff)) ** 2, m_eff).sqrt(),
            "adv_min": masked_min(adv, m_eff),
            "adv_max": masked_max(adv, m_eff),
            "excluded_tokens": (m & ~m_eff).sum().to(dtype),
        }
        if ret is not None:
            stats["returns_mean"] = masked_mean(ret, m_eff)
        metrics = _floats(out.metrics)
        metrics["nonfinite_rewards"] = float(n_bad)
        keys = list(stats)
        vals = torch.stack([stats[k].to(dtype) for k in keys]).tolist()
        metrics.update(zip(keys, vals, strict=True))
    return AdvantageResult(adv, ret, metrics, m_eff)


def _floats(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in (metrics or {}).items():
        out[k] = float(v.detach().item()) if isinstance(v, Tensor) else float(v)
    return out
