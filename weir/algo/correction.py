"""Rollout / trainer mismatch: measurement and importance-sampling corrections.

The engine that samples tokens (vLLM, SGLang, or weir's torch engine in another
precision) does not compute exactly the trainer's probabilities, so "on-policy" data is
slightly off-policy. Yao et al. 2025 ("Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training") correct it with a truncated importance weight
``pi_train / pi_rollout``. :func:`rollout_correction` computes those weights (or masks
outliers) and always reports how far the two sets of log-probs are apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ._checks import (
    check_finite_where,
    check_float_tensor,
    check_mask,
    check_positive,
    check_shape,
    masked_max,
    masked_mean,
    sanitize,
)
from .registry import suggest

__all__ = ["CORRECTION_MODES", "CorrectionResult", "rollout_correction"]

CORRECTION_MODES = (
    "none",
    "token_tis",
    "seq_tis",
    "token_mask",
    "seq_mask",
    "token_mis",
    "seq_mis",
)
CorrectionMode = Literal[
    "none", "token_tis", "seq_tis", "token_mask", "seq_mask", "token_mis", "seq_mis"
]

LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class CorrectionResult:
    """Output of :func:`rollout_correction`.

    Attributes:
        weights: [B, T] detached per-token weights, 0 where ``mask`` is 0; pass as
            ``weights=`` to :func:`weir.algo.compute_policy_loss`.
        mask: [B, T] bool, the input mask minus the tokens / sequences that a ``*_mask``
            mode rejected; use it for the loss and the global counts.
        metrics: python floats (see :func:`rollout_correction`).
    """

    weights: Tensor
    mask: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def rollout_correction(
    train_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    mode: CorrectionMode = "none",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
    seq_ratio: Literal["product", "geometric"] = "product",
) -> CorrectionResult:
    """Importance weights or rejection masks for the rollout/trainer mismatch.

    Per token ``delta = clamp(train_logp - rollout_logp, -20, 20)`` and
    ``rho = exp(delta)``; per sequence ``rho_seq = exp(clamp(sum_t delta, -20, 20))``
    (``seq_ratio="product"``, the sequence likelihood ratio) or
    ``exp(mean_t delta)`` (``"geometric"``), over the trained tokens.

    * ``none``: weights = 1 on trained tokens; metrics only.
    * ``token_tis``: ``w = min(rho, cap)`` (truncated IS, Yao et al. 2025).
    * ``seq_tis``: ``w = min(rho_seq, cap)`` on every token of the sequence.
    * ``token_mask``: weight 1, tokens with ``rho`` outside ``[low, high]`` removed
      from the mask.
    * ``seq_mask``: weight 1, sequences with ``rho_seq`` outside ``[low, high]``
      removed from the mask.
    * ``token_mis``: masked importance sampling per token, ``w = rho`` where
      ``low <= rho <= high``, the token removed otherwise (IcePop, Ling Team 2025).
    * ``seq_mis``: ``w = rho_seq`` on every token of a sequence with
      ``low <= rho_seq <= high``, the sequence removed otherwise (MIS, Liu, Li et al. 2025).

    Named combinations with their published bands are in :mod:`weir.algo.correction_presets`.

    ``train_logp`` should be the trainer's log-probs of the policy that generated the
    batch (e.g. the ``old_logp`` recomputed before the update), ``rollout_logp`` the
    engine's. Call it on the whole batch so that the returned mask can give the global
    token count. All outputs are detached.

    Args:
        train_logp, rollout_logp: [B, T] float.
        mask: [B, T] 0/1.
        mode: one of :data:`CORRECTION_MODES` (default ``none``).
        cap: truncation ``C`` for the ``*_tis`` modes (> 0, default 2.0).
        low, high: acceptance interval for the ``*_mask`` and ``*_mis`` modes
            (``0 <= low < high``, defaults 0.5 and 2.0).
        seq_ratio: ``product`` (default) or ``geometric``.

    Returns:
        :class:`CorrectionResult` with metrics (python floats, over trained tokens):
        ratio_mean, ratio_max (token ratios), seq_ratio_mean, seq_ratio_max,
        kl_k3 (mean of ``rho - 1 - log rho``, estimating KL(rollout || train)),
        kl_k1 (mean of ``rollout_logp - train_logp``), abs_logp_diff_mean,
        abs_logp_diff_max, truncated_frac (tokens whose weight hit the cap),
        masked_frac (share of trained tokens removed), masked_seq_frac (share of
        sequences with trained tokens that lost all of them).

    Bad input:
        ValueError for shape / dtype mismatches, an empty batch, a non-0/1 mask, an unknown
        mode, invalid ``cap`` / ``low`` / ``high``, or NaN/inf log-probs at a trained
        position (masked positions are never read). A mask that selects nothing gives
        zero weights and zero metrics.
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(
            f"mode: unknown correction mode {mode!r}; valid: {', '.join(CORRECTION_MODES)}"
            f"{suggest(str(mode), CORRECTION_MODES)}"
        )
    if seq_ratio not in ("product", "geometric"):
        raise ValueError(f"seq_ratio: expected 'product' or 'geometric', got {seq_ratio!r}")
    cap = check_positive("cap", cap)
    low = check_positive("low", low, allow_zero=True)
    high = check_positive("high", high)
    if not low < high:
        raise ValueError(f"low, high: expected low < high, got low={low}, high={high}")
    train_logp = check_float_tensor("train_logp", train_logp, ndim=2)
    rollout_logp = check_float_tensor("rollout_logp", rollout_logp, ndim=2)
    m = check_mask("mask", mask, train_logp.shape)
    check_shape("rollout_logp", rollout_logp, train_logp.shape, "same as train_logp")
    check_finite_where({"train_logp": train_logp, "rollout_logp": rollout_logp}, m)

    with torch.no_grad():
        dtype = torch.promote_types(train_logp.dtype, torch.float32)
        raw = sanitize(train_logp.detach().to(dtype) - rollout_logp.detach().to(dtype), m)
        delta = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        rho = torch.exp(delta)
        n_b = m.sum(dim=1)
        has = n_b > 0
        seq_log = delta.sum(dim=1)
        if seq_ratio == "geometric":
            seq_log = seq_log / n_b.clamp(min=1).to(dtype)
        rho_seq = torch.exp(seq_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        rho_seq_tok = rho_seq.unsqueeze(1).expand_as(rho)

        new_mask = m
        truncated = torch.zeros_like(m)
        if mode == "token_tis":
            truncated = m & (rho > cap)
            weights = rho.clamp(max=cap)
        elif mode == "seq_tis":
            truncated = m & (rho_seq_tok > cap)
            weights = rho_seq_tok.clamp(max=cap)
        else:
            weights = torch.ones_like(rho)
            if mode in ("token_mask", "token_mis"):
                new_mask = m & (rho >= low) & (rho <= high)
            elif mode in ("seq_mask", "seq_mis"):
                ok = (rho_seq >= low) & (rho_seq <= high)
                new_mask = m & ok.unsqueeze(1)
            if mode == "token_mis":
                weights = rho
            elif mode == "seq_mis":
                weights = rho_seq_tok
        weights = sanitize(weights, new_mask)

        n_tok = m.sum().clamp(min=1).to(dtype)
        n_seq = has.sum().clamp(min=1).to(dtype)
        lost_seq = has & ~new_mask.any(dim=1)
        stats = {
            "ratio_mean": masked_mean(rho, m),
            "ratio_max": masked_max(rho, m),
            "seq_ratio_mean": masked_mean(rho_seq, has),
            "seq_ratio_max": masked_max(rho_seq, has),
            "kl_k3": masked_mean(torch.expm1(delta) - delta, m),
            "kl_k1": masked_mean(-raw, m),
            "abs_logp_diff_mean": masked_mean(raw.abs(), m),
            "abs_logp_diff_max": masked_max(raw.abs(), m),
            "truncated_frac": truncated.sum().to(dtype) / n_tok,
            "masked_frac": (m & ~new_mask).sum().to(dtype) / n_tok,
            "masked_seq_frac": lost_seq.sum().to(dtype) / n_seq,
        }
        keys = list(stats)
        values = torch.stack([stats[k].to(dtype) for k in keys]).tolist()
    return CorrectionResult(weights, new_mask, dict(zip(keys, values, strict=True)))
