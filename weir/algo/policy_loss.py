"""Policy-gradient losses and :func:`compute_policy_loss`, the validated front door.

Every registered loss has the signature::

    fn(logp, old_logp, advantages, mask, *, [behavior_logp=...,] **options)
        -> (per_token_loss [B, T], metrics: dict[str, Tensor | float])

``logp`` [B, T] are the current policy's log-probs (with grad), ``old_logp`` the
log-probs of the policy that the ratio is taken against (for PPO: recomputed by the
trainer before the update; for decoupled PPO: the *proximal* policy), ``mask`` is a bool
[B, T]. :func:`compute_policy_loss` zeroes every input at masked positions before the
call, multiplies the per-token loss by the optional correction ``weights``, aggregates
it with global counts (:mod:`weir.algo.aggregation`) and adds optional KL / entropy
terms. User losses with the same signature plug in by dotted path.

Metrics are means over the trained tokens of the tensors passed in (one micro-batch);
``tokens`` gives that count so the trainer can weight them when it combines micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

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
    sanitize,
)
from .aggregation import AggMode, _aggregate, check_agg
from .kl import KL_KINDS, KLKind, kl_penalty
from .registry import Registry, call_with_options, resolve, suggest

__all__ = [
    "POLICY_LOSSES",
    "LOG_RATIO_CLAMP",
    "compute_policy_loss",
    "policy_loss_terms",
    "ppo",
    "gspo",
    "cispo",
    "reinforce",
    "decoupled_ppo",
]

POLICY_LOSSES = Registry("policy loss")

LOG_RATIO_CLAMP = 20.0


def _check_eps(eps_low: float | None, eps_high: float, *, low_optional: bool = False) -> None:
    if eps_low is None and low_optional:
        pass
    else:
        lo = check_finite_number("eps_low", eps_low)  # type: ignore[arg-type]
        if not 0.0 <= lo <= 1.0:
            raise ValueError(f"eps_low: expected a number in [0, 1], got {eps_low!r}")
    check_positive("eps_high", eps_high, allow_zero=True)


def _check_dual(dual_clip: float | None) -> None:
    if dual_clip is not None:
        c = check_finite_number("dual_clip", dual_clip)
        if c <= 1.0:
            raise ValueError(f"dual_clip: expected a number > 1 (or None), got {dual_clip!r}")


def _need_old(old_logp: Tensor | None, who: str) -> Tensor:
    if old_logp is None:
        raise ValueError(f"old_logp: the {who!r} loss needs the old (proximal) log-probs")
    return old_logp


def _log_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    return (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _k3_from_log_ratio(log_ratio: Tensor) -> Tensor:
    return torch.expm1(log_ratio) - log_ratio


def _ratio_metrics(log_ratio: Tensor, ratio: Tensor, m: Tensor) -> dict[str, Tensor]:
    lr = log_ratio.detach()
    return {
        "approx_kl": masked_mean(_k3_from_log_ratio(lr), m),
        "ratio_mean": masked_mean(ratio.detach(), m),
        "ratio_max": masked_max(ratio.detach(), m),
    }


def _clipped_surrogate(
    ratio: Tensor,
    adv: Tensor,
    m: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.where(surr2 > surr1, surr2, surr1)
    r = ratio.detach()
    metrics = {
        "clipfrac_low": masked_mean(((adv < 0) & (r < 1.0 - eps_low)).to(r.dtype), m),
        "clipfrac_high": masked_mean(((adv > 0) & (r > 1.0 + eps_high)).to(r.dtype), m),
    }
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["clipfrac_dual"] = masked_mean(dual.to(r.dtype), m)
    return loss, metrics


@POLICY_LOSSES.register("ppo")
def ppo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher and dual clip.

    ``rho = exp(clamp(logp - old_logp, -20, 20))``::

        l = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))
        l = min(l, -A c)   where A < 0, when dual_clip = c > 1

    Asymmetric bounds are DAPO's clip-higher (Yu et al. 2025: ``eps_high = 0.28``); the
    dual clip bounds the loss of negative-advantage tokens whose ratio exploded (Ye et al.
    2020). Inside the clip range the gradient is ``-A rho grad(logp)``; on the clipped
    side it is 0.

    Options: ``eps_low=0.2``, ``eps_high=0.2``, ``dual_clip=None`` (off).
    Metrics: clipfrac_low (A < 0, rho < 1 - eps_low), clipfrac_high (A > 0,
    rho > 1 + eps_high), clipfrac_dual (A < 0, loss capped), approx_kl (k3 of
    KL(old || new), ``rho - 1 - log rho``), ratio_mean, ratio_max.
    """
    _need_old(old_logp, "ppo")
    _check_eps(eps_low, eps_high)
    _check_dual(dual_clip)
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    loss, metrics = _clipped_surrogate(ratio, advantages, mask, eps_low, eps_high, dual_clip)
    return loss, {**metrics, **_ratio_metrics(log_ratio, ratio, mask)}


@POLICY_LOSSES.register("gspo")
def gspo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO, sequence-level clipped ratio (Zheng et al. 2025, Group Sequence Policy Opt.).

    ``s_i = exp(mean_{t in y_i} (logp - old_logp))``, the geometric mean of the token
    ratios of sequence ``i`` (log clamped to [-20, 20]). Per token, in the GSPO-token
    form ``s_{i,t} = sg(s_i) * exp(logp_t - sg(logp_t))`` (value ``s_i``, gradient
    ``s_i grad(logp_t)``)::

        l_{i,t} = max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - eps_low, 1 + eps_high))

    With a sequence-level advantage and ``seq-mean-token-mean`` aggregation (GSPO's
    objective) this is exactly ``-(1/S) sum_i min(s_i A_i, clip(s_i) A_i)`` and its
    gradient. Whole sequences are clipped together.

    Options: ``eps_low=3e-4``, ``eps_high=4e-4`` (the GSPO paper's values; note the
    scale: sequence ratios stay much closer to 1 than token ratios).
    Metrics: clipfrac_low / clipfrac_high (fraction of tokens in clipped sequences),
    approx_kl (token-level k3), ratio_mean / ratio_max (of the sequence ratios ``s_i``).
    """
    _need_old(old_logp, "gspo")
    _check_eps(eps_low, eps_high)
    n_b = mask.sum(dim=1)
    seq_log_ratio = (logp - old_logp).detach().sum(dim=1) / n_b.clamp(min=1).to(logp.dtype)
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_log_ratio = seq_log_ratio.unsqueeze(1) + logp - logp.detach()
    ratio = torch.exp(token_log_ratio)
    loss, metrics = _clipped_surrogate(ratio, advantages, mask, eps_low, eps_high, None)
    s = torch.exp(seq_log_ratio)
    has = n_b > 0
    metrics.update(
        approx_kl=masked_mean(_k3_from_log_ratio(_log_ratio(logp, old_logp).detach()), mask),
        ratio_mean=masked_mean(s, has),
        ratio_max=masked_max(s, has),
    )
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float | None = None,
    eps_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO, clipped importance-sampling weight policy optimisation (MiniMax-M1, 2025).

    ``rho = exp(clamp(logp - old_logp, -20, 20))``,
    ``w = sg(clip(rho, 1 - eps_low, 1 + eps_high))``, ``l = -w A logp``.

    Unlike PPO no token loses its gradient: the weight is truncated, the gradient
    ``-w A grad(logp)`` always flows.

    Options: ``eps_low=None`` (no lower bound, as in MiniMax-M1), ``eps_high=0.2`` (the
    paper tunes only this bound and publishes no single default; 0.2 mirrors PPO).
    Metrics: clipfrac_low (rho < 1 - eps_low), clipfrac_high (rho > 1 + eps_high), both
    regardless of the sign of A; approx_kl; ratio_mean; ratio_max.
    """
    _need_old(old_logp, "cispo")
    _check_eps(eps_low, eps_high, low_optional=True)
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio).detach()
    lo = None if eps_low is None else 1.0 - eps_low
    w = ratio.clamp(min=lo, max=1.0 + eps_high)
    loss = -w * advantages * logp
    metrics = {
        "clipfrac_low": masked_mean((ratio < lo).to(ratio.dtype), mask)
        if lo is not None
        else ratio.new_zeros(()),
        "clipfrac_high": masked_mean((ratio > 1.0 + eps_high).to(ratio.dtype), mask),
        **_ratio_metrics(log_ratio, ratio, mask),
    }
    return loss, metrics


@POLICY_LOSSES.register("reinforce")
def reinforce(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Vanilla on-policy policy gradient (REINFORCE, Williams 1992): ``l = -A logp``.

    No ratio, no clipping: correct only for on-policy data (one optimizer step per
    batch). ``old_logp`` may be None; when given it is used only for the ratio metrics.
    No options.
    """
    loss = -advantages * logp
    if old_logp is None:
        return loss, {}
    log_ratio = _log_ratio(logp, old_logp).detach()
    return loss, _ratio_metrics(log_ratio, torch.exp(log_ratio), mask)


@POLICY_LOSSES.register("decoupled_ppo")
def decoupled_ppo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    behavior_logp: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    tis_cap: float | None = 2.0,
    cap_mode: Literal["truncate", "mask"] = "truncate",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization";
    Fu et al. 2025, AReaL) for stale / asynchronous rollouts.

    Three policies: ``behavior_logp`` from the engine that sampled the tokens,
    ``old_logp`` = the *proximal* policy (recomputed by the trainer before the update),
    ``logp`` the current one. The trust region is taken around the proximal policy and the
    off-policyness between behaviour and proximal is corrected by a detached weight::

        rho = exp(clamp(logp - prox, -20, 20))
        w   = sg(exp(clamp(prox - behav, -20, 20)))      capped at tis_cap
        l   = w * max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))   (+ dual clip)

    ``cap_mode="truncate"`` uses ``min(w, tis_cap)`` (truncated IS, Yao et al. 2025);
    ``cap_mode="mask"`` sets ``w = 0`` above the cap (AReaL's ``behav_imp_weight_cap``).
    ``tis_cap=None`` leaves ``w`` uncapped.

    Options: ``eps_low=0.2``, ``eps_high=0.2``, ``dual_clip=None``, ``tis_cap=2.0``,
    ``cap_mode="truncate"``.
    Metrics: the PPO metrics against the proximal policy, plus behav_weight_mean,
    behav_weight_max (before the cap), behav_capped_frac, behav_kl (k3 of
    KL(behavior || proximal)).
    """
    _need_old(old_logp, "decoupled_ppo")
    _check_eps(eps_low, eps_high)
    _check_dual(dual_clip)
    if tis_cap is not None:
        check_positive("tis_cap", tis_cap)
    if cap_mode not in ("truncate", "mask"):
        raise ValueError(
            f"cap_mode: expected 'truncate' or 'mask', got {cap_mode!r}"
            f"{suggest(str(cap_mode), ['truncate', 'mask'])}"
        )
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    loss, metrics = _clipped_surrogate(ratio, advantages, mask, eps_low, eps_high, dual_clip)
    behav_log_w = _log_ratio(old_logp, behavior_logp).detach()
    w_raw = torch.exp(behav_log_w)
    if tis_cap is None:
        capped = torch.zeros_like(mask)
        w = w_raw
    else:
        capped = w_raw > tis_cap
        w = w_raw.clamp(max=tis_cap) if cap_mode == "truncate" else torch.where(capped, 0.0, w_raw)
    metrics.update(_ratio_metrics(log_ratio, ratio, mask))
    metrics.update(
        behav_weight_mean=masked_mean(w_raw, mask),
        behav_weight_max=masked_max(w_raw, mask),
        behav_capped_frac=masked_mean(capped.to(w.dtype), mask),
        behav_kl=masked_mean(_k3_from_log_ratio(behav_log_w), mask),
    )
    return w * loss, metrics


def _loss_name(name_or_fn: str | Callable[..., Any]) -> str:
    if isinstance(name_or_fn, str):
        return name_or_fn
    return getattr(name_or_fn, "__qualname__", repr(name_or_fn))


def compute_policy_loss(
    name_or_fn: str | Callable[..., Any],
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    agg: AggMode,
    num_tokens: float,
    num_seqs: float,
    max_len: int | None = None,
    behavior_logp: Tensor | None = None,
    weights: Tensor | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    **options: Any,
) -> tuple[Tensor, dict[str, float]]:
    """Policy loss of one micro-batch, aggregated with global counts.

    ``loss = agg(weights * l_pg) + kl_coef * agg(kl(logp, ref_logp)) - entropy_coef *
    agg(entropy)`` where ``l_pg`` is the per-token loss of ``name_or_fn`` and ``agg`` is
    :func:`weir.algo.aggregate_loss` with ``num_tokens`` / ``num_seqs`` / ``max_len``
    of the *whole optimizer batch*; so summing the returned losses of the micro-batches
    (or ranks) gives the loss and gradient of the full batch.

    Args:
        name_or_fn: ``ppo``, ``gspo``, ``cispo``, ``reinforce``, ``decoupled_ppo``, a
            dotted path or a callable (see the module docstring for the signature).
        logp: [B, T] current log-probs (requires grad).
        old_logp: [B, T] log-probs the ratio is taken against (proximal policy for
            ``decoupled_ppo``); may be None for ``reinforce``. Detached.
        advantages: [B, T]. Detached.
        mask: [B, T] 0/1; use ``AdvantageResult.mask`` or ``CorrectionResult.mask``.
        agg: aggregation mode, see :data:`weir.algo.AGG_MODES`.
        num_tokens, num_seqs, max_len: global normalisers, see :func:`aggregate_loss`.
        behavior_logp: [B, T] engine log-probs (``decoupled_ppo`` only).
        weights: [B, T] per-token weights multiplied into the policy-gradient loss, e.g.
            ``CorrectionResult.weights``. Detached; not applied to the KL/entropy terms.
        ref_logp: [B, T] reference log-probs; with ``kl_coef != 0`` adds the KL loss term
            (GRPO's ``beta``), and in any case reports ``kl_ref``.
        kl_coef: KL loss coefficient (default 0). kl_kind: ``k1``/``k2``/``k3`` (k3).
        entropy: [B, T] per-token entropy (with grad, from
            :func:`weir.algo.entropy_from_logits`); reports ``entropy`` and, with
            ``entropy_coef != 0``, subtracts the bonus.
        **options: loss options (e.g. ``eps_high=0.28``, ``dual_clip=3.0``,
            ``tis_cap=2.0``); an option the loss does not take is a ValueError.

    Bad input:
        ValueError for wrong types, shapes (every tensor must be [B, T] like ``logp``), an
        empty batch, a non-0/1 mask, NaN/inf in any input at a trained position, an unknown
        loss / option / aggregation mode, non-positive counts, or a missing
        ``behavior_logp`` / ``old_logp`` / ``ref_logp`` that the call needs. Values at masked
        positions are never read (they may be NaN) and receive zero gradient. A mask that
        selects nothing is allowed (a micro-batch holding only excluded samples): the loss
        is 0, the gradient is 0 and the metrics are 0.

    Returns:
        ``(loss, metrics)``: a scalar tensor with grad, and python floats: loss, pg_loss,
        tokens (trained tokens in this micro-batch), the loss's own metrics (clipfrac_low,
        clipfrac_high, approx_kl, ratio_mean, ratio_max, ...), kl_ref and entropy when
        given.
    """
    loss, stats = policy_loss_terms(
        name_or_fn,
        logp,
        old_logp,
        advantages,
        mask,
        agg=agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        max_len=max_len,
        behavior_logp=behavior_logp,
        weights=weights,
        ref_logp=ref_logp,
        kl_coef=kl_coef,
        kl_kind=kl_kind,
        entropy=entropy,
        entropy_coef=entropy_coef,
        check_values=True,
        **options,
    )
    keys = list(stats)
    values = torch.stack([stats[k].to(dtype=torch.float32) for k in keys]).tolist()
    metrics = dict(zip(keys, values, strict=True))
    if not all(map(math.isfinite, values)):
        bad = [k for k, v in metrics.items() if not math.isfinite(v)]
        raise ValueError(
            f"policy loss {_loss_name(name_or_fn)!r} produced non-finite {', '.join(bad)} from "
            "finite inputs"
        )
    return loss, metrics


def policy_loss_terms(
    name_or_fn: str | Callable[..., Any],
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    agg: AggMode,
    num_tokens: float,
    num_seqs: float,
    max_len: int | None = None,
    behavior_logp: Tensor | None = None,
    weights: Tensor | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    check_values: bool = False,
    **options: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`compute_policy_loss` without reading the device: the loss and its metrics as 0-d tensors
    (on `logp`'s device), no check of the values (the mask's 0s and 1s, finiteness: unless
    `check_values`), one micro-batch at no host synchronisation. For the trainer, whose inputs
    are checked where they are made and which reads every micro-batch's metrics in one transfer
    per step; a non-finite input reaches the loss."""
    fn = resolve(name_or_fn, POLICY_LOSSES)
    who = _loss_name(name_or_fn)
    check_agg(agg, max_len)
    n_tok = check_positive("num_tokens", num_tokens)
    n_seq = check_positive("num_seqs", num_seqs)
    kl_coef = check_finite_number("kl_coef", kl_coef)
    if kl_kind not in KL_KINDS:
        raise ValueError(
            f"kl_kind: unknown KL estimator {kl_kind!r}; valid: {', '.join(KL_KINDS)}"
            f"{suggest(str(kl_kind), KL_KINDS)}"
        )
    entropy_coef = check_finite_number("entropy_coef", entropy_coef)
    logp = check_float_tensor("logp", logp, ndim=2)
    m = check_mask("mask", mask, logp.shape) if check_values else _mask_layout(mask, logp.shape)
    shape = tuple(logp.shape)
    tensors: dict[str, Tensor | None] = {
        "old_logp": old_logp,
        "advantages": advantages,
        "behavior_logp": behavior_logp,
        "weights": weights,
        "ref_logp": ref_logp,
        "entropy": entropy,
    }
    for k, v in tensors.items():
        if v is not None:
            check_float_tensor(k, v, ndim=2)
            check_shape(k, v, shape, "same as logp: (batch, response_tokens)")
    if advantages is None:
        check_tensor("advantages", advantages)
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError("ref_logp: kl_coef != 0 needs the reference log-probs ref_logp=")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy: entropy_coef != 0 needs the per-token entropy entropy=")
    if check_values:
        check_finite_where({"logp": logp, **tensors}, m)

    def clean(x: Tensor | None, detach: bool = True) -> Tensor | None:
        if x is None:
            return None
        return sanitize(x.detach() if detach else x, m).to(logp.dtype)

    lp = sanitize(logp, m)
    call_opts = dict(options)
    if behavior_logp is not None:
        call_opts["behavior_logp"] = clean(behavior_logp)
    per_tok, raw_metrics = _unpack(
        call_with_options(
            fn, (lp, clean(old_logp), clean(advantages), m), call_opts, kind="policy loss"
        ),
        who,
    )
    check_tensor(f"{who} per-token loss", per_tok)
    check_shape(f"{who} per-token loss", per_tok, shape, "same as logp")
    per_tok = sanitize(per_tok, m)
    if weights is not None:
        per_tok = per_tok * clean(weights)

    pg_loss = _aggregate(per_tok, m, agg, n_tok, n_seq, max_len)
    loss = pg_loss
    stats: dict[str, Tensor] = {}
    if ref_logp is not None:
        kl = kl_penalty(lp, clean(ref_logp), kl_kind)  # type: ignore[arg-type]
        stats["kl_ref"] = masked_mean(kl.detach(), m)
        if kl_coef != 0.0:
            loss = loss + kl_coef * _aggregate(kl, m, agg, n_tok, n_seq, max_len)
    if entropy is not None:
        ent = clean(entropy, detach=False)
        stats["entropy"] = masked_mean(ent.detach(), m)  # type: ignore[union-attr]
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * _aggregate(ent, m, agg, n_tok, n_seq, max_len)  # type: ignore[arg-type]

    stats["loss"] = loss.detach()
    stats["pg_loss"] = pg_loss.detach()
    stats["tokens"] = m.sum()
    for k, v in raw_metrics.items():
        stats[k] = v.detach() if isinstance(v, Tensor) else torch.tensor(float(v))
    return loss, {k: v.to(logp.device) for k, v in stats.items()}


def _mask_layout(mask: object, shape: tuple[int, ...]) -> Tensor:
    """The mask as bool, its shape checked but not its values (no device read)."""
    mask = check_tensor("mask", mask)
    check_shape("mask", mask, shape, "(batch, response_tokens)")
    if mask.numel() == 0:
        raise ValueError(f"mask: empty batch, got shape {tuple(mask.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def _unpack(out: Any, who: str) -> tuple[Tensor, dict[str, Any]]:
    if isinstance(out, Tensor):
        return out, {}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Tensor):
        return out[0], dict(out[1] or {})
    raise ValueError(
        f"policy loss {who!r} returned {type(out).__name__}; expected (per_token_loss, metrics)"
    )
